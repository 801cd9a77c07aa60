"""Weights moved between optimizer steps: what happened to a component's parameters after its optimizers' last
step and before their next one, compared with what the optimizer's own step did to them.

A fingerprint of the parameters: per tensor its L2 norm, L1 norm and sum, taken at three hooks around each due step
``D`` (the logging steps, not the anomaly windows): after the last optimizer step of ``D - 1`` (its post-hook),
before the first of ``D`` (its pre-hook) and after the last of ``D``. Nothing a healthy loop does between two
optimizer steps touches the trained tensors, so the first two are bit-identical; a reversed EMA
(``p.copy_(decay * ema_p + (1 - decay) * p)`` into the trained model) or a checkpoint reloaded every epoch moves them
by about as much as the optimizer's step does. The fingerprint is not the movement itself: each of its numbers is a
projection of it (on the weights' direction, on their signs, on the ones vector), so it is judged against the same
projections of the optimizer's own update at ``D`` (scale-free: a reversed EMA gives 0.1-1 in the corpus, rounding
noise of a perturb-and-restore ~1e-4).

Left out of the judgement (they move legitimately between steps, or are moved by something else):
  * tensors whose move is a pure shrink: L2 and L1 not up and ``|d sum| <= -d L1`` (what any elementwise shrink
    toward zero gives): weight clipping, max-norm projections and pruning masks applied after the step;
  * tensors in shared memory (``p.is_shared()``: Hogwild's workers step them from other processes), frozen ones,
    and tensors another component's optimizer also steps;
  * a whole component whose optimizer the user handed behind a wrapper that may move the weights itself after the
    inner optimizer's step (Lookahead's slow-weight sync, ``ZeroRedundancyOptimizer``'s broadcast): only
    accelerate's and Lightning's wrappers, which only step the inner optimizer, are looked through.
Emits per judged component at each due step that had both fingerprints:
  ``diag/[<c>/]moved/ratio``: over the judged tensors whose move is not a pure shrink, the sum of their relative
      fingerprint changes between the steps (``|dL2|/L2 + |dL1|/L1 + |d sum|/L1``), over the same sum of the
      optimizer's step at ``D`` over all judged tensors (0 in a healthy loop; ``nan`` when the step changed nothing);
  ``diag/[<c>/]moved/tensors``: judged tensors whose fingerprint changed at all between the steps;
  table ``[<c>/]moved/layers``: ``{layer: its share of the ratio}`` for the layers counted in ``moved/ratio``.
A fingerprint reads at most ~262,144 values of a component: each tensor at most its share of them (1,024 to 65,536
values, :func:`cap_of`), as the first values of 64 evenly spaced runs (:func:`sample_of`, a view; every fingerprint of
the run the same ones): what moves every weight moves them. On the CPU (in the training loop) the probe's hooks on the
784-1024-1024-10 MLP at ``advanced`` ~245 -> ~85 us a step, on 100 tensors of ~42,000 values ~1,120 -> ~420 us.
Cost on a due step, per component: three fingerprints (each a ``sum`` per tensor and two ``_foreach_norm``; on the
CPU past ``SEGMENTED`` tensors one copy of the sampled values and three segment sums), a ``[3, n]`` tensor kept
between two hooks, host work at publish; on other steps two schedule look-ups.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.optimizers import chain_of
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe, take_pending
from trackdiag.util.norms import tensor_norms
from trackdiag.util.ranks import local

#: the relative rounding of a norm or sum taken twice that still counts as shrinking (a fingerprint is one fp32 reduction)
TOLERANCE = 1e-6
#: the top-level packages of optimizer wrappers that only step the optimizer they wrap
PASS_THROUGH = ("accelerate", "lightning", "pytorch_lightning")


#: a fingerprint reads at most about BUDGET values of a component: each tensor at most its share (between MIN_CAP and
#: MAX_CAP values), as the first values of RUNS evenly spaced runs (a view)
BUDGET, MIN_CAP, MAX_CAP, RUNS = 1 << 18, 1 << 10, 1 << 16, 64
#: a component of more tensors on the CPU is fingerprinted from one copy of its sampled values (three segment sums), not
#: by a kernel per tensor and two foreach kernels: 1,000 tensors, the probe's hooks ~4.7 -> ~2.6 ms a step
SEGMENTED = 64


def cap_of(tensors: int) -> int:
    """The values a fingerprint reads of each of a component's ``tensors`` tensors at most."""
    return max(MIN_CAP, min(MAX_CAP, BUDGET // max(tensors, 1)))


def sample_of(t: torch.Tensor, cap: int = MAX_CAP) -> torch.Tensor:
    """``t`` itself when it has at most ``cap`` values (or is not contiguous), else a ``(RUNS, cap // RUNS)`` view of
    it: the first values of each of ``RUNS`` equal stretches. What moves every weight (a reversed EMA, a checkpoint
    reloaded) moves these; a change confined to the values between them goes unseen."""
    n = t.numel()
    if n <= cap or not t.is_contiguous() or t.layout is not torch.strided:
        return t
    per = n // RUNS
    return t.view(-1)[: per * RUNS].view(RUNS, per)[:, : cap // RUNS]


def segmented(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The ``[3, n]`` fp32 fingerprint of many tensors from one copy of their values: per tensor the square root of its
    sum of squares, its sum of absolute values and its sum (three ``segment_reduce`` sums)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    if flat.is_complex():  # .float() would drop the imaginary parts (with a warning): the caller's way instead
        raise TypeError("complex parameters")
    flat = flat.float()
    lengths = torch.tensor([t.numel() for t in tensors], device=flat.device)
    sums = torch.segment_reduce(flat, "sum", lengths=lengths, initial=0.0)
    l1 = torch.segment_reduce(flat.abs(), "sum", lengths=lengths, initial=0.0)
    l2 = torch.segment_reduce(flat * flat, "sum", lengths=lengths, initial=0.0).sqrt()
    return torch.stack([l2, l1, sums])


class MovedProbe(Probe):
    """See module docstring."""

    name = "moved"
    follows_anomaly = False  # three fingerprints a step: not on every step of an anomaly window

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._after: dict[str, tuple[int, int, torch.Tensor]] = {}  # comp -> (generation, step, fingerprint after its last step)
        self._between: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # comp -> (generation, pre fingerprint, its change)
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._masks: dict[str, tuple[int, np.ndarray]] = {}  # comp -> (generation, judged tensors)

    @torch.no_grad()
    def _fingerprint(self, comp: Component) -> torch.Tensor:
        """``[3, n]`` (fp32): per parameter tensor its L2 norm, its L1 norm and its sum, of its :func:`sample_of` at
        the component's :func:`cap_of` (every fingerprint of the run the same values; a component none of whose
        tensors is sampled takes the index's cached L2 norms)."""
        idx = comp.index
        params = [local(p.detach()) for p in idx.params] if idx.sharded else idx.params
        wide = torch.float32 if idx.low_precision else None
        cap = cap_of(len(params))
        sampled = [sample_of(p, cap) for p in params]
        if len(sampled) > SEGMENTED and sampled[0].device.type == "cpu":  # elsewhere: a host copy of the lengths a step
            try:
                return segmented(sampled)
            except (RuntimeError, TypeError):  # complex, sparse, several devices: a kernel or two per tensor
                pass
        if all(s is p for s, p in zip(sampled, params)):
            l2 = idx.param_norms().float()  # shared with the other probes due at this hook
        else:
            params = sampled
            l2 = tensor_norms(params, 2.0, wide).float()
        try:  # the L1 norms by one foreach kernel: on the CPU it loops in C++, a Python abs + sum per tensor cost more
            l1 = tensor_norms(params, 1.0, wide).float().to(l2.device)
            sums = torch.stack([p.sum(dtype=wide) for p in params]).float()
        except (RuntimeError, TypeError):  # complex or sparse parameters: the L2 norms alone
            l1 = sums = torch.zeros_like(l2)
        return torch.stack([l2, l1, sums.to(l2.device)])

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        after = self._after.pop(comp.name, None)
        if after is None or not self.schedule(ctx.step) or after[0] != comp.generation or after[1] != ctx.step - 1:
            return
        fp = self._fingerprint(comp)
        if fp.shape == after[2].shape:
            self._between[comp.name] = (comp.generation, fp, fp - after[2])

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        """Every optimizer of the component: the last one of a step leaves its fingerprint."""
        due, next_due = comp.name in self._between and self.schedule(ctx.step), self.schedule(ctx.step + 1)
        if not (due or next_due) or not comp.index.params:
            return
        fp = self._fingerprint(comp)
        if due:
            gen, pre, moved = self._between[comp.name]
            if gen == comp.generation and pre.shape == fp.shape:
                self._pending[comp.name] = {"pre": pre, "between": moved, "step": fp - pre}
        if next_due:
            self._after[comp.name] = (comp.generation, ctx.step, fp)

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        self._between.clear()
        if self._after and not self.schedule(ctx.step + 1):
            self._after.clear()

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return take_pending(self._pending)

    def _judged(self, ctx: ProbeContext, comp: Component) -> np.ndarray:
        """Which of ``comp``'s tensors are judged (host work, once per index generation)."""
        held = self._masks.get(comp.name)
        if held is not None and held[0] == comp.generation:
            return held[1]
        others = {id(p) for c in ctx.components if c is not comp for p in c.index.params}
        mask = np.array([p.requires_grad and not p.is_shared() and id(p) not in others for p in comp.index.params])
        if any(_moves_weights(g) for g in comp.given):
            mask[:] = False
        self._masks[comp.name] = (comp.generation, mask)
        return mask

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            pre = values.get(f"{comp.name}|pre")
            if pre is None:
                continue
            mask = self._judged(ctx, comp)
            if not mask.any() or pre.size != 3 * mask.size:
                continue
            pre, between, step = (values[f"{comp.name}|{k}"].reshape(3, -1) for k in ("pre", "between", "step"))
            l2, l1 = pre[0], pre[1]
            scale = np.stack([l2, l1, l1])
            scale = np.where(scale > 0, scale, np.inf)
            tol = TOLERANCE * scale[:2]  # the fp32 rounding of two reductions of the same tensor
            shrunk = (between[:2] <= tol).all(axis=0) & (np.abs(between[2]) <= -between[1] + tol[1])
            unexplained = mask & ~shrunk & (between != 0).any(axis=0)
            num = (np.abs(between) / scale).sum(axis=0) * unexplained
            den = (np.abs(step) / scale).sum(axis=0) * mask
            total = float(den.sum())
            ratio = float(num.sum()) / total if total > 0 else math.nan  # nan too where a weight is not finite
            record.scalars[comp.key("moved/ratio")] = ratio
            record.scalars[comp.key("moved/tensors")] = float((mask & (between != 0).any(axis=0)).sum())
            if ratio > 0 and math.isfinite(ratio):
                layers: dict[str, list[float]] = {}
                for i in np.flatnonzero(num):
                    layers.setdefault(comp.index.layers[comp.index.index_of[i]], []).append(float(num[i]))
                record.tables[comp.key("moved/layers")] = {k: sum(v) / total for k, v in layers.items()}

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        for held in (self._after, self._between, self._pending, self._masks):
            held.pop(comp.name, None)

    def detach(self) -> None:
        self._after.clear()
        self._between.clear()


def _moves_weights(opt: Any) -> bool:
    """Whether ``opt`` is a wrapper (of a package other than accelerate's and Lightning's) whose ``step`` may change
    the weights after its inner optimizer's step."""
    chain = chain_of(opt)
    return any(type(o).__module__.split(".")[0] not in PASS_THROUGH for o in chain[:-1])

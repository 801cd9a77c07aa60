"""Update-to-weight ratio probe: how far one step moves each layer, relative to its size.

Measured on due steps (every step of the first ``early`` steps, then every ``every``), whatever
updates the weights:
  * a component whose optimizer steps: the parameters are copied at its first step pre-hook (``step(closure)``:
    at the closure's first backward pass, after what the closure did to the weights before its forward) (one
    foreach copy, after the backward pass, so the copy never coexists with the activations) and
    compared right after that optimizer's step (its post-hook: a renormalisation or clamp the loop
    applies afterwards is not the optimizer's update), or, with several optimizers on the component,
    at ``Diagnostics.step`` after every one of them ran;
  * a component without an optimizer (hand-written ``p.data.add_(...)``): copied at the previous
    ``Diagnostics.step`` and compared at this one;
  * a component whose optimizer did not step (an optimizer the user stopped calling): when none of
    its parameters' version counters moved, the update is exactly zero (host check, no copy).
Emits per component:
  ``diag/[<c>/]update/ratio/<layer>``: ||w_new - w_old|| / ||w_old|| of the layer's parameters
      (``nan`` for a layer whose weights are all zero); coarsened to the key budget like the
      gradient keys, the full per-layer table in ``record.tables`` when coarsened;
  ``diag/[<c>/]update/ratio_median``: the median over layers with weights (~1e-3 is the usual healthy value);
  ``diag/[<c>/]update/global_ratio``: the same ratio over all trainable parameters at once (frozen
      ones an optimizer holds do not dilute it).
  ``diag/[<c>/]update/step_size``: the same over the parameters that were not all zero when first measured
      (a textbook ``w = 0`` logistic regression, zero-initialised biases: their first steps make the weights,
      so "larger than the weights" says nothing; ``nan`` when every parameter started at zero). The rule for
      steps larger than the weights reads it.
  table ``diag/[<c>/]update/born_zero`` (when there are any): ``{layer: 1.0}`` for the layers whose every parameter
      was all zero when first measured (a decoder whose weight is tied to the embedding keeps only its zero-initialised
      bias; a zero-initialised head): their ratio is to a size their own steps made.
  ``diag/[<c>/]update/idle_steps`` (every logging step, while > 0): consecutive steps in which
      backward passes reached the component but none of its optimizers stepped (an ``optimizer.step()``
      the loop stopped calling), with the table ``update/idle`` = ``{"since": first such step}``;
      not counted under an enabled ``GradScaler`` (its skips are the AMP rules' business).
Cost on a due step: a copy of the parameters (1x parameter memory; transient, except on the CPU
up to ``KEEP_BYTES``, where the buffers are kept: a fresh allocation costs ~10x the copy there), two
``_foreach_norm`` and one ``_foreach_sub_`` kernels, two ``index_add_``. Nothing on other steps but
host counters. A ``GradScaler``-skipped step is not measured.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe, take_pending
from trackdiag.probes.grads import publish_layers
from trackdiag.util.norms import tensor_norms
from trackdiag.util.schedule import EarlyThenEvery

KEEP_BYTES = 256 * 2**20  # CPU parameters up to this size keep their copy buffers between due steps


class UpdateProbe(Probe):
    """See module docstring. Args: ``early`` steps measured one by one at the start."""

    name = "updates"
    due_only = True  # hooks act on due steps only: the session skips them otherwise
    follows_anomaly = False  # too costly to run on every step of an anomaly window
    always_collect = True  # the idle-optimizer counters

    def __init__(self, *, enabled: bool = True, every: int | None = None, early: int = 10) -> None:
        super().__init__(enabled=enabled, every=every)
        self.early = max(0, early)
        self._snap: dict[str, tuple[int, Sequence[torch.Tensor], torch.Tensor]] = {}
        self._versions: dict[str, list[int]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._idle: dict[str, tuple[int, int]] = {}  # component -> (idle steps, first idle step)
        self._gap: dict[str, int] = {}  # component -> the longest run of idle steps between two of its optimizer steps
        self._keep: dict[str, tuple[int, list[torch.Tensor]]] = {}  # component -> (generation, CPU copy buffers)
        self._live: dict[tuple[str, int], torch.Tensor] = {}  # (component, generation) -> requires_grad mask
        self._born: dict[tuple[str, int], torch.Tensor] = {}  # (component, generation) -> not all zero when first measured

    def bind(self, default_every: int) -> None:
        self.schedule = EarlyThenEvery(self.early, self.every or default_every, type(self).follows_anomaly)

    def attach(self, ctx: ProbeContext) -> None:
        self._prepare(ctx, 0)

    @torch.no_grad()
    def _copy(self, comp: Component) -> tuple[int, Sequence[torch.Tensor], torch.Tensor]:
        params = comp.index.params  # under no_grad: no detach() per tensor (2.8 us each on the CPU)
        # fp16/bf16 weights: accumulate the norms in fp32 (their squares overflow fp16 above ~256)
        wide = torch.float32 if comp.index.low_precision else None
        return comp.generation, self._copy_of(comp, params), tensor_norms(params, dtype=wide).float()

    def _copy_of(self, comp: Component, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of ``params``. CPU parameters of at most ``KEEP_BYTES`` are copied into buffers kept
        between due steps: there a fresh allocation is page-faulted in on every due step, ~10x the
        copy itself (3.4 vs 0.34 ms for 17 MB on a 2-core VM). Elsewhere the copy is transient (the
        CUDA caching allocator reuses its blocks; the memory serves activations in between)."""
        kept = self._keep.get(comp.name)
        if kept is not None and kept[0] == comp.generation and len(kept[1]) == len(params):
            try:
                torch._foreach_copy_(kept[1], params)
                return kept[1]
            except RuntimeError:  # a parameter changed shape or dtype in place: new buffers
                pass
        self._keep.pop(comp.name, None)
        if any(p.device.type != "cpu" for p in params) or sum(p.numel() * p.element_size() for p in params) > KEEP_BYTES:
            return torch._foreach_mul(params, 1.0)
        buffers = [torch.empty_like(p) for p in params]
        torch._foreach_copy_(buffers, params)
        self._keep[comp.name] = (comp.generation, buffers)
        return buffers

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        if ctx.is_due(self.schedule) and comp.index.params:
            self._snap[comp.name] = self._copy(comp)  # replaces a copy taken at the last step()

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        """A component with one optimizer: its update is measured as soon as that optimizer has stepped,
        so what the loop does to the weights afterwards (decoder columns renormalised, weights clamped
        or projected) is not taken for the optimizer's step. Several optimizers: at ``step()``."""
        snap = self._snap.get(comp.name)
        if snap is None or snap[0] != comp.generation or len(comp.optimizers) != 1:
            return
        del self._snap[comp.name]
        with torch.no_grad():
            self._pending[comp.name] = self._diff(comp, snap[1], snap[2])

    def _count_idle(self, ctx: ProbeContext) -> None:
        scaled = ctx.scaler is not None and bool(getattr(ctx.scaler, "_enabled", False))
        for comp in ctx.components:
            if not comp.optimizers or comp.name in ctx.stepped or scaled:
                n, _ = self._idle.pop(comp.name, (0, 0))
                if n and comp.name in ctx.stepped:  # its optimizer stepped again after n idle steps: its rhythm
                    self._gap[comp.name] = max(self._gap.get(comp.name, 0), n)
            elif comp.name in ctx.backward_seen:
                n, since = self._idle.get(comp.name, (0, ctx.step))
                self._idle[comp.name] = (n + 1, since)

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        self._count_idle(ctx)
        due = ctx.is_due(self.schedule)
        if not due and not self._snap and not self._due_at(ctx, ctx.step + 1):
            self._versions.clear()  # neither this step nor the next is measured: nothing to keep
            return
        with torch.no_grad():
            self._measure(ctx, due)

    def _due_at(self, ctx: ProbeContext, step: int) -> bool:
        return self.schedule(step) or (step <= ctx.anomaly_until and self.follows_anomaly)

    def _measure(self, ctx: ProbeContext, due: bool) -> None:
        for comp in ctx.components:
            snap = self._snap.pop(comp.name, None)
            if not due or not comp.index.params:
                continue
            if snap is not None and snap[0] == comp.generation:
                if comp.optimizers and comp.name not in ctx.stepped and ctx.scaler is not None:
                    continue  # a GradScaler-skipped step
                self._pending[comp.name] = self._diff(comp, snap[1], snap[2])
            elif comp.optimizers and comp.name not in ctx.stepped and comp.name in self._versions:
                # unchanged because its optimizer stopped, not because this step fell between the steps of an
                # optimizer that steps every other step (TD3's and SAC's delayed actor updates): a zero only once it
                # has been idle longer than it ever was between two of its steps
                idle = self._idle.get(comp.name, (0, 0))[0]
                if idle > self._gap.get(comp.name, 0) and [p._version for p in comp.index.params] == self._versions[comp.name]:
                    n = len(comp.index.layers)
                    self._pending[comp.name] = {"ratio": torch.zeros(n), "global_ratio": torch.zeros(()), "step_size": torch.zeros(()),
                                                **({"group_ratio": torch.zeros(len(comp.index.groups))} if comp.index.grouped else {})}
        self._prepare(ctx, ctx.step + 1)

    def _prepare(self, ctx: ProbeContext, step: int) -> None:
        """Before due step ``step``: copy hook-less components, note the others' version counters."""
        if not self._due_at(ctx, step):
            self._versions.clear()
            return
        for comp in ctx.components:
            if not comp.index.params:
                continue
            if comp.optimizers:
                self._versions[comp.name] = [p._version for p in comp.index.params]
            else:
                self._snap[comp.name] = self._copy(comp)

    def _diff(self, comp: Component, old: Sequence[torch.Tensor], w_norms: torch.Tensor) -> dict[str, torch.Tensor]:
        torch._foreach_sub_(list(old), comp.index.params)  # old := w_old - w_new (under no_grad)
        d_norms = tensor_norms(list(old), dtype=torch.float32 if comp.index.low_precision else None).float()
        del old
        idx = comp.index
        lw, ld = idx.per_layer_norm(w_norms), idx.per_layer_norm(d_norms)
        nan = torch.full_like(lw, math.nan)
        live = self._trainable(comp, w_norms)  # frozen weights in the optimizer do not dilute the whole-model ratio
        step = torch.linalg.vector_norm(d_norms * live)
        born = live * self._not_born_zero(comp, w_norms)
        out = {"ratio": torch.where(lw > 0, ld / lw, nan),  # its median is taken on the host (CUDA's nanmedian syncs)
               "global_ratio": step / torch.linalg.vector_norm(w_norms * live),
               "step_size": torch.linalg.vector_norm(d_norms * born) / torch.linalg.vector_norm(w_norms * born),
               # layers whose every parameter was all zero when first measured: their size is what their steps made
               "born_zero": ((idx.per_layer_norm(w_norms * born) == 0) & (lw > 0)).float()}
        if idx.grouped:
            gw, gd = idx.per_group_norm(lw), idx.per_group_norm(ld)
            out["group_ratio"] = torch.where(gw > 0, gd / gw, torch.full_like(gw, math.nan))
        return out

    def _not_born_zero(self, comp: Component, w_norms: torch.Tensor) -> torch.Tensor:
        """1.0 for parameters that were not all zero at the component's first measured step (of this index
        generation), 0.0 for those that were: kept on the device, taken from the first step's norms."""
        key = (comp.name, comp.generation)
        mask = self._born.get(key)
        if mask is None or mask.device != w_norms.device or mask.shape != w_norms.shape:
            mask = (w_norms > 0).float()
            self._born = {k: v for k, v in self._born.items() if k[0] != comp.name}  # its newest generation's only
            self._born[key] = mask
        return mask

    def _trainable(self, comp: Component, like: torch.Tensor) -> torch.Tensor:
        """1.0 for parameters that require a gradient, 0.0 for frozen ones (kept per index generation:
        built again only when the parameters change)."""
        key = (comp.name, comp.generation)
        mask = self._live.get(key)
        if mask is None or mask.device != like.device:
            # made on the device (a tensor from host data is a synchronous copy on CUDA)
            mask = torch.stack([(p.new_ones(()) if p.requires_grad else p.new_zeros(())).float() for p in comp.index.params])
            mask = mask.to(like.device)
            self._live = {k: v for k, v in self._live.items() if k[0] != comp.name}
            self._live[key] = mask
        return mask

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out = take_pending(self._pending)
        for name, (n, _) in self._idle.items():
            out[f"{name}|idle_steps"] = float(n)
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            idle = self._idle.get(comp.name)
            if idle is not None and f"{comp.name}|idle_steps" in values:
                record.scalars[comp.key("update/idle_steps")] = float(idle[0])
                record.tables[comp.key("update/idle")] = {"since": float(idle[1])}
            ratio = values.get(f"{comp.name}|ratio")
            if ratio is None:
                continue
            finite = ratio[~np.isnan(ratio)]
            record.scalars[comp.key("update/ratio_median")] = float(np.median(finite)) if finite.size else math.nan
            record.scalars[comp.key("update/global_ratio")] = float(values[f"{comp.name}|global_ratio"][0])
            if f"{comp.name}|step_size" in values:
                record.scalars[comp.key("update/step_size")] = float(values[f"{comp.name}|step_size"][0])
            publish_layers(comp.key("update/ratio"), comp, ratio, record, values.get(f"{comp.name}|group_ratio"))
            born = values.get(f"{comp.name}|born_zero")
            if born is not None and len(born) == len(comp.index.layers) and born.any():
                record.tables[comp.key("update/born_zero")] = {
                    layer: 1.0 for layer, b in zip(comp.index.layers, born.tolist()) if b}

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        self._pending.pop(comp.name, None)
        self._versions.pop(comp.name, None)
        self._keep.pop(comp.name, None)

    def detach(self) -> None:
        self._snap.clear()
        self._keep.clear()

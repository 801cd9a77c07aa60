"""Gradients-not-zeroed probe: did the gradients the optimizer consumed get reset before the next one?

How: after a due optimizer step, one gradient hook is put on a single "sentinel" parameter (the last
one that has a gradient). The hook runs at every backward until the next optimizer step and sees
the sentinel's gradient *before* the new one is accumulated into it: ``None`` (``zero_grad()``
with ``set_to_none``) or all zeros (``zero_grad(set_to_none=False)``) means the gradients were reset.
At the next optimizer step the verdict is: not zeroed iff at least one backward ran and none of
them saw a reset. This is exact and has no false positives for:

- ``zero_grad(set_to_none=True)`` / ``zero_grad()`` anywhere between two steps (before the forward,
  between forward and backward, after the step);
- gradient accumulation over k micro-batches per step (the first backward sees the reset, the
  later ones see this step's own partial sums, which never count against it);
- GAN-style loops where another loss backpropagates into this model before it is zeroed;
- closure optimizers (LBFGS) and steps with no backward in between: no verdict.

With ``accumulation_steps`` = k > 1 the gradients may legitimately be carried across k optimizer
steps: the watch spans k steps and only a run of k steps without any reset counts.

Emits per component, at the logging step after the verdict: ``diag/[<c>/]grad/not_zeroed`` (1.0 or
0.0) and the table ``diag/[<c>/]grad/zero_check`` = ``{"step": the optimizer step that used the
stale gradients, "backwards": backward passes seen}``.
Cost: on a due step, one hook registration; per backward until the next step, one all-zero test of
one tensor (on device, no sync); nothing on other steps. The hook is a tensor hook on a leaf
parameter (fine under DDP; not under FSDP's flat parameters).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trackdiag.context import Component, ProbeContext
from trackdiag.errors import ConfigError
from trackdiag.probes.base import Probe
from trackdiag.record import Record


@dataclass
class _Watch:
    """One armed check: the hook on the sentinel and what it saw."""

    param: torch.Tensor
    steps_left: int
    ctx: ProbeContext | None = None
    handle: Any = None
    backwards: int = 0
    reset_seen: bool = False  # a None gradient was seen (known on the host)
    reset_dev: torch.Tensor | None = None  # device bool: an all-zero gradient was seen

    @torch.no_grad()
    def __call__(self, _new_grad: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.backwards += 1
        g = self.param.grad
        if g is None:
            self.reset_seen = True
        elif not self.reset_seen:
            zero = ~g.detach().ne(0).any()
            self.reset_dev = zero if self.reset_dev is None else self.reset_dev | zero
        if self.ctx is not None:
            self.ctx.hook_seconds += time.perf_counter() - t0


class ZeroGradProbe(Probe):
    """See module docstring. Args: ``accumulation_steps`` optimizer steps the gradients may legitimately span."""

    name = "zerograd"

    def __init__(self, *, enabled: bool = True, every: int | None = None, accumulation_steps: int = 1) -> None:
        super().__init__(enabled=enabled, every=every)
        if accumulation_steps < 1:
            raise ConfigError([f"diag.probes.zerograd.accumulation_steps: must be >= 1, got {accumulation_steps!r}"])
        self.accumulation_steps = accumulation_steps
        self._watch: dict[str, _Watch] = {}
        self._verdicts: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        self._meta: dict[str, list[tuple[int, int]]] = {}

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        w = self._watch.get(comp.name)
        if w is None:
            return
        w.steps_left -= 1
        if w.steps_left > 0:
            return
        self._disarm(comp.name)
        if w.backwards == 0:  # closure optimizer, or a step without backward: no verdict
            return
        if w.reset_seen or w.reset_dev is None:
            stale = torch.zeros((), device=w.param.device)
        else:
            stale = (~w.reset_dev).float()
        self._verdicts.setdefault(comp.name, []).append((ctx.step, w.backwards, stale))

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        if comp.name in self._watch or not ctx.is_due(self.schedule):
            return
        sentinel = next((p for p in reversed(comp.index.params) if p.grad is not None and p.requires_grad), None)
        if sentinel is None:
            return
        w = _Watch(sentinel, self.accumulation_steps, ctx)
        w.handle = sentinel.register_hook(w)
        self._watch[comp.name] = w

    def _disarm(self, name: str) -> None:
        w = self._watch.pop(name, None)
        if w is not None and w.handle is not None:
            w.handle.remove()

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._meta = {}
        for name, verdicts in self._verdicts.items():
            if verdicts:
                dev = verdicts[-1][2].device
                out[name] = torch.stack([v.to(dev) for _, _, v in verdicts])
                self._meta[name] = [(s, b) for s, b, _ in verdicts]
        self._verdicts = {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            vals = values.get(comp.name)
            if vals is None:
                continue
            meta = self._meta.get(comp.name, [])
            bad = [i for i, v in enumerate(vals.tolist()) if v > 0.5]
            record.scalars[comp.key("grad/not_zeroed")] = 1.0 if bad else 0.0
            step, backwards = meta[bad[0]] if bad else meta[-1]
            record.tables[comp.key("grad/zero_check")] = {"step": float(step), "backwards": float(backwards)}

    def detach(self) -> None:
        for name in list(self._watch):
            self._disarm(name)

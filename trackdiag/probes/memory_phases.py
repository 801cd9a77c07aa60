"""Memory per training phase, CUDA only: where in the step the memory goes.

On scheduled steps, reads ``torch.cuda.memory_allocated`` (a host-side counter: no sync) at four
points of the step and emits ``diag/[<c>/]mem/phase/<phase>_mb``:
  ``start``: before the forward; ``forward``: after the forward (activations kept for backward);
  both seen through trackdiag's global forward watcher (nothing is stored on the model);
  ``backward``: at the optimizer's pre-step hook (gradients allocated, activations freed);
  ``step``: at the optimizer's post-step hook (optimizer state allocated).
The forward readings are armed only for the due step (at the end of the previous step) and taken
at the first forward; with gradient accumulation the first micro-batch is measured. Models on the
CPU: nothing is watched or emitted. On a model compiled before the session, the forward phases are
not measured (the watcher would invalidate its graphs once).
"""
from __future__ import annotations

from typing import Any

import torch

from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.forward_watch import FORWARD, may_watch
from trackdiag.probes.base import Probe


def _cuda_device(comp: Component) -> torch.device | None:
    p = comp.index.params[0] if comp.index.params else None
    return p.device if p is not None and p.device.type == "cuda" else None


class MemoryPhasesProbe(Probe):
    """See module docstring."""

    name = "memory_phases"
    due_only = True  # reads allocator counters on due steps only: the session skips the hook calls elsewhere

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._armed: set[str] = set()
        self._stops: list[Any] = []
        self._values: dict[str, float] = {}
        self._devices: dict[str, torch.device] = {}

    def attach(self, ctx: ProbeContext) -> None:
        watch = may_watch(ctx.compiled)
        for comp in ctx.components:
            dev = _cuda_device(comp)
            if dev is not None and comp.model is not None:
                self._devices[comp.name] = dev
                if watch:
                    root = comp.outer if comp.outer is not None else comp.model
                    self._stops.append(FORWARD.watch(
                        root, pre=lambda *_, c=comp, d=dev: self._pre(c, d),
                        post=lambda *_, c=comp, d=dev: self._after_forward(c, d), root=True))
        if self._devices and self._due(ctx, ctx.step):
            self._arm(ctx)

    def _due(self, ctx: ProbeContext, step: int) -> bool:
        return self.schedule(step) or step <= ctx.anomaly_until

    def _arm(self, ctx: ProbeContext) -> None:
        """Measure the root modules' next forward only."""
        self._armed = set(self._devices)

    def _pre(self, comp: Component, dev: torch.device) -> None:
        if comp.name in self._armed:
            self._read(comp, dev, "start")

    def _read(self, comp: Component, dev: torch.device, phase: str) -> None:
        self._values.setdefault(comp.key(f"mem/phase/{phase}_mb"), torch.cuda.memory_allocated(dev) / 2**20)

    def _after_forward(self, comp: Component, dev: torch.device) -> None:
        if comp.name in self._armed:
            self._read(comp, dev, "forward")
            self._armed.discard(comp.name)  # one-shot

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        dev = self._devices.get(comp.name)
        if dev is not None and self._due(ctx, ctx.step):
            self._read(comp, dev, "backward")

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        dev = self._devices.get(comp.name)
        if dev is not None and self._due(ctx, ctx.step):
            self._read(comp, dev, "step")

    def quiet(self, ctx: ProbeContext) -> bool:
        return not self._devices and not self._armed

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._devices and self._due(ctx, ctx.step + 1):
            self._arm(ctx)
        else:
            self._armed.clear()

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out, self._values = self._values, {}
        return out

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()
        self._armed.clear()

"""Memory per training phase, CUDA only: where in the step the memory goes.

On scheduled steps, reads ``torch.cuda.memory_allocated`` (a host-side counter: no sync) at four
points of the step and emits ``diag/[<c>/]mem/phase/<phase>_mb``:
  ``start``: before the forward (a forward pre-hook on the root module);
  ``forward``: after the forward (activations kept for backward; a forward hook on the root module);
  ``backward``: at the optimizer's pre-step hook (gradients allocated, activations freed);
  ``step``: at the optimizer's post-step hook (optimizer state allocated).
The root-module hooks are attached only for the due step (registered at the end of the previous
step, removed after the first forward they see); with gradient accumulation the first micro-batch
is measured. Models on the CPU: nothing is hooked or emitted.
"""
from __future__ import annotations

from typing import Any

import torch

from trackdiag.context import Component, ProbeContext, StepInputs
from trackdiag.probes.base import Probe
from trackdiag.tensors import SafeHook


def _cuda_device(comp: Component) -> torch.device | None:
    p = comp.index.params[0] if comp.index.params else None
    return p.device if p is not None and p.device.type == "cuda" else None


class MemoryPhasesProbe(Probe):
    """See module docstring."""

    name = "memory_phases"

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._handles: dict[str, list[Any]] = {}
        self._values: dict[str, float] = {}
        self._devices: dict[str, torch.device] = {}

    def attach(self, ctx: ProbeContext) -> None:
        for comp in ctx.components:
            dev = _cuda_device(comp)
            if dev is not None and comp.model is not None:
                self._devices[comp.name] = dev
        if self._devices and self._due(ctx, ctx.step):
            self._arm(ctx)

    def _due(self, ctx: ProbeContext, step: int) -> bool:
        return self.schedule(step) or step <= ctx.anomaly_until

    def _arm(self, ctx: ProbeContext) -> None:
        """Hook the root modules for their next forward only."""
        self.detach()
        for comp in ctx.components:
            dev = self._devices.get(comp.name)
            if dev is not None and comp.model is not None:
                self._handles[comp.name] = [
                    comp.model.register_forward_pre_hook(SafeHook(lambda *_, c=comp, d=dev: self._read(c, d, "start"))),
                    comp.model.register_forward_hook(SafeHook(lambda *_, c=comp, d=dev: self._after_forward(c, d))),
                ]

    def _read(self, comp: Component, dev: torch.device, phase: str) -> None:
        self._values.setdefault(comp.key(f"mem/phase/{phase}_mb"), torch.cuda.memory_allocated(dev) / 2**20)

    def _after_forward(self, comp: Component, dev: torch.device) -> None:
        self._read(comp, dev, "forward")
        for h in self._handles.pop(comp.name, []):  # one-shot
            h.remove()

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        dev = self._devices.get(comp.name)
        if dev is not None and self._due(ctx, ctx.step):
            self._read(comp, dev, "backward")

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        dev = self._devices.get(comp.name)
        if dev is not None and self._due(ctx, ctx.step):
            self._read(comp, dev, "step")

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._devices and self._due(ctx, ctx.step + 1):
            self._arm(ctx)
        else:
            self.detach()

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out, self._values = self._values, {}
        return out

    def detach(self) -> None:
        for handles in self._handles.values():
            for h in handles:
                h.remove()
        self._handles.clear()

"""Train/eval mode probe: a model left in eval mode while its optimizer steps.

``model.eval()`` before the loop (or a validation pass without ``model.train()`` after it) freezes
dropout and BatchNorm's statistics while the weights keep training: the run goes on, quietly worse.
At each optimizer step of a component (its first step pre-hook), the probe reads the root module's
``training`` flag; the first time it is ``False`` it lists the modules whose behaviour depends on
the mode (``Dropout`` family with ``p > 0``, BatchNorm/InstanceNorm with running statistics) and
are in eval mode. A model in train mode whose BatchNorm layers were put in eval on purpose (frozen
statistics of a fine-tuned backbone) is a choice, not reported.

Emits, at the next logging step after such a step, per component: ``diag/[<c>/]model/eval_mode``
(1.0), the table ``[<c>/]model/eval_modules`` = ``{module: 1.0 dropout | 2.0 normalisation}`` and
``model/eval_mode_step`` = ``{"step": first such step}``.
Cost: one attribute read per optimizer step; one host pass over the modules the first time.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORM = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def mode_dependent(model: nn.Module) -> dict[str, float]:
    """``{module: 1.0 (dropout) | 2.0 (normalisation)}`` of the modules in eval mode whose output
    depends on the mode; host pass over the modules."""
    out: dict[str, float] = {}
    for name, m in model.named_modules():
        if m.training:
            continue
        if isinstance(m, _DROPOUT) and getattr(m, "p", 0.0) > 0:
            out[name or "(root)"] = 1.0
        elif isinstance(m, _NORM) and getattr(m, "track_running_stats", False):
            out[name or "(root)"] = 2.0
    return out


class ModeProbe(Probe):
    """See module docstring."""

    name = "modes"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._found: dict[str, tuple[int, dict[str, float]]] = {}
        self._reported: set[str] = set()

    def bind(self, default_every: int) -> None:
        self.schedule = Never()  # never the reason for a logging step

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        model = comp.model
        if model is None or model.training or comp.name in self._reported or comp.name in self._found:
            return
        self._found[comp.name] = (ctx.step, mode_dependent(model))  # none: only a functional dropout would care

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        """A component stepped by hand (no optimizer object): read the mode at ``step()``."""
        for comp in ctx.components:
            if not comp.optimizers and comp.name in ctx.backward_seen:
                self.before_optimizer_step(ctx, comp)

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return {"found": float(len(self._found))} if self._found else {}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            found = self._found.pop(comp.name, None)
            if found is None:
                continue
            self._reported.add(comp.name)
            step, modules = found
            record.scalars[comp.key("model/eval_mode")] = 1.0
            record.tables[comp.key("model/eval_modules")] = modules
            record.tables[comp.key("model/eval_mode_step")] = {"step": float(step), "modules": float(len(modules))}

    def state_dict(self) -> dict[str, Any]:
        return {"reported": sorted(self._reported)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reported = set(state.get("reported", []))

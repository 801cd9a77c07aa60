"""Train/eval mode probe: a model left in eval mode while its optimizer steps.

``model.eval()`` before the loop (or a validation pass without ``model.train()`` after it) freezes
dropout and BatchNorm's statistics while the weights keep training: the run goes on, quietly worse.
At each optimizer step of a component (its first step pre-hook), the probe reads the root module's
``training`` flag; the first time it is ``False`` it lists the modules whose behaviour depends on
the mode (``Dropout`` family with ``p > 0``, BatchNorm/InstanceNorm with running statistics) and
are in eval mode. A model in train mode whose BatchNorm layers were put in eval on purpose (frozen
statistics of a fine-tuned backbone) is a choice, not reported; so is a model kept in eval on purpose
with nothing there to train: when no module in eval mode holds a parameter that requires a gradient and
that the component's optimizers step (a frozen feature extractor, a trainable head in train mode), the
optimizer cannot change what eval mode affects, and nothing is emitted. That verdict is kept until
the model is seen in train mode again or its parameters change (a layer unfrozen, a param group added).

Emits, at the next logging step after such a step, per component: ``diag/[<c>/]model/eval_mode``
(1.0), the table ``[<c>/]model/eval_modules`` = ``{module: 1.0 dropout | 2.0 normalisation}`` and
``model/eval_mode_step`` = ``{"step": first such step}``.
Cost: one attribute read per optimizer step (a dict look-up more while a model stays in eval with
nothing to train); one host pass over the modules and the optimizers' parameters the first time the
model is seen in eval mode (again after it was in train mode or its parameters changed).
"""
from __future__ import annotations

from typing import Any

import numpy as np
from torch import nn

from trackdiag.capture.components import component_params
from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never

#: the nn.Dropout family (also read by the layer_args probe)
DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_NORM = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def mode_dependent(model: nn.Module, training: bool = False) -> dict[str, float]:
    """``{module: 1.0 (dropout) | 2.0 (normalisation)}`` of the modules in eval mode (``training``: in training
    mode) whose output depends on the mode; host pass over the modules."""
    out: dict[str, float] = {}
    for name, m in model.named_modules():
        if m.training != training:
            continue
        if isinstance(m, DROPOUT) and getattr(m, "p", 0.0) > 0:
            out[name or "(root)"] = 1.0
        elif isinstance(m, _NORM) and getattr(m, "track_running_stats", False):
            out[name or "(root)"] = 2.0
    return out


def trains_in_eval(comp: Component) -> bool:
    """Whether a module of ``comp``'s model in eval mode holds a parameter its optimizers can change: one
    that requires a gradient and is in their param groups (without an optimizer object: any that requires
    a gradient; an optimizer that holds copies, fp32 masters or flat shards, none of the model's own: the
    model's flags). Host pass over the modules and the param groups."""
    model = comp.model
    if model is None:
        return False
    in_eval = {id(p) for m in model.modules() if not m.training for p in m.parameters(recurse=False)}
    if not in_eval:
        return False
    mine = {id(p) for p in model.parameters()}
    held = [p for p in component_params(comp) if id(p) in mine] or list(model.parameters())
    return any(p.requires_grad and id(p) in in_eval for p in held)


class ModeProbe(Probe):
    """See module docstring."""

    name = "modes"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._found: dict[str, tuple[int, dict[str, float]]] = {}
        self._reported: set[str] = set()
        self._idle: dict[str, int] = {}  # in eval with nothing to train: the component's generation then

    def bind(self, default_every: int) -> None:
        self.schedule = Never()  # never the reason for a logging step

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        model = comp.model
        if model is None or comp.name in self._reported or comp.name in self._found:
            return
        if model.training:
            if self._idle:
                self._idle.pop(comp.name, None)  # a later eval() is judged afresh
            return
        if self._idle.get(comp.name) == comp.generation:
            return
        if not trains_in_eval(comp):  # kept in eval on purpose (a frozen feature extractor): nothing to say
            self._idle[comp.name] = comp.generation
            return
        self._found[comp.name] = (ctx.step, mode_dependent(model))  # none: only a functional dropout would care

    def quiet(self, ctx: ProbeContext) -> bool:
        return all(comp.optimizers for comp in ctx.components)  # the optimizer hook reads the mode instead

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

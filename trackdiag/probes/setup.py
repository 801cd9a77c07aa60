"""Set-up probe: parameters that should train but that no optimizer steps, and parameters an
optimizer holds that are frozen.

At the first step (and whenever a component is re-indexed: a param group added, layers unfrozen)
it lists, per component with an optimizer, the model's parameters that require a gradient, received
one, but are in none of the component's optimizers' param groups: a head replaced after the optimizer was
built, a layer forgotten in a hand-built param group list. A layer frozen on purpose
(``requires_grad=False``) is not listed. Emits the table ``diag/[<c>/]setup/unoptimized`` =
``{layer: number of values}`` at the next logging step (only when some are found), and
``diag/[<c>/]setup/frozen`` for parameters that are in an optimizer but do not require a gradient
(frozen by mistake before or after the optimizer was built: they never get one).
When the component's optimizers step no parameter of its model, only other tensors (an input optimised:
style transfer, adversarial examples, feature visualisation step an image), it also emits
``diag/[<c>/]setup/inputs`` = ``{"tensors": n, "values": numel}``: the model is held fixed on purpose.
Cost: one host pass over the model's parameters at those steps; nothing else.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from trackdiag.capture.components import stepped_inputs
from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.layers import layer_of
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe


def frozen(comp: Component) -> dict[str, float]:
    """``{layer: values}`` of ``comp``'s optimizers' parameters that do not require a gradient."""
    if not comp.optimizers:
        return {}
    out: dict[str, float] = {}
    for name, p in zip(comp.index.names, comp.index.params):
        if not p.requires_grad:
            layer = layer_of(name)
            out[layer] = out.get(layer, 0.0) + float(p.numel())
    return out


def unoptimized(comp: Component, graded: set[int] | None = None) -> dict[str, float]:
    """``{layer: values}`` of ``comp``'s trainable model parameters that no optimizer of it steps and
    that received a gradient (in ``graded``, or holding one now): a parameter that gets no gradient
    (a later phase's layer, an unused module) loses nothing by not being in an optimizer."""
    if comp.model is None or not comp.optimizers:
        return {}
    stepped = {id(p) for p in comp.index.params}
    out: dict[str, float] = {}
    for name, p in comp.model.named_parameters():
        got = p.grad is not None or (graded is not None and id(p) in graded)
        if p.requires_grad and id(p) not in stepped and got:
            layer = layer_of(name)
            out[layer] = out.get(layer, 0.0) + float(p.numel())
    return out


class SetupProbe(Probe):
    """See module docstring."""

    name = "setup"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._due: set[str] = set()
        self._found: dict[str, dict[str, float]] = {}
        self._frozen: dict[str, dict[str, float]] = {}
        self._inputs: dict[str, dict[str, float]] = {}
        self._graded: dict[str, set[int]] = {}  # parameters holding a gradient at the first optimizer step

    def bind(self, default_every: int) -> None:
        from trackdiag.util.schedule import Never

        self.schedule = Never()  # never the reason for a logging step

    def attach(self, ctx: ProbeContext) -> None:
        self._due = {c.name for c in ctx.components}

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        self._due.add(comp.name)

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        """The gradients as the backward pass left them (a loop may zero them before ``step()``)."""
        if comp.name in self._due and comp.model is not None:
            self._graded[comp.name] = {id(p) for p in comp.model.parameters() if p.grad is not None}

    def quiet(self, ctx: ProbeContext) -> bool:
        return not self._due  # re-indexing makes a component due again (and replans)

    def idle_before_step(self, ctx: ProbeContext) -> bool:
        return not self._due

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        """After the step's optimizers ran (late ones were adopted by now)."""
        for comp in ctx.components:
            if comp.name in self._due and comp.optimizers:
                self._due.discard(comp.name)
                found = unoptimized(comp, self._graded.pop(comp.name, None))
                if found:
                    self._found[comp.name] = found
                    stepped = stepped_inputs(comp)
                    if stepped:
                        self._inputs[comp.name] = {"tensors": float(len(stepped)),
                                                   "values": float(sum(p.numel() for p in stepped))}
                cold = frozen(comp)
                if cold:
                    self._frozen[comp.name] = cold

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return {"found": float(len(self._found) + len(self._frozen))} if self._found or self._frozen else {}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            found = self._found.pop(comp.name, None)
            if found:
                record.tables[comp.key("setup/unoptimized")] = found
            stepped = self._inputs.pop(comp.name, None)
            if stepped:
                record.tables[comp.key("setup/inputs")] = stepped
            cold = self._frozen.pop(comp.name, None)
            if cold:
                record.tables[comp.key("setup/frozen")] = cold

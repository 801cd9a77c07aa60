"""``grads_not_zeroed``: the optimizer stepped on gradients still holding the previous step's values."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule


def flagged(record: Record, components: Sequence[Component], flag: str, table: str) -> list[tuple[Component, int, int]]:
    """``(component, optimizer step, backward passes)`` for each component whose zerograd ``flag``
    is set in ``record``; the step and pass count come from the probe's ``table``."""
    out = []
    for comp in components:
        if record.scalars.get(comp.key(flag), 0.0) >= 0.5:
            meta = record.tables.get(comp.key(table), {})
            out.append((comp, int(meta.get("step", record.step)), int(meta.get("backwards", 0))))
    return out


class GradsNotZeroed(Rule):
    """Fires when the ``zerograd`` probe saw no gradient reset between two optimizer steps
    (``diag/grad/not_zeroed`` == 1). Exact, so no patience: ``step`` is the optimizer step that used the
    accumulated gradients; ``where`` the component (``""`` for one model)."""

    kind = "grads_not_zeroed"
    hint = ("Call optimizer.zero_grad(set_to_none=True) once per optimizer step (after optimizer.step(), or before "
            "the next backward). To accumulate over micro-batches, zero only after each optimizer step; if you "
            "deliberately carry gradients across k optimizer steps, set diag.probes.zerograd.accumulation_steps=k (Python: probes={'zerograd': {'accumulation_steps': k}}).")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp, step, n in flagged(record, components, "grad/not_zeroed", "grad/zero_check"):
            msg = (f"gradients were not zeroed before optimizer step {step}: after {n} backward pass(es) they still "
                   f"held the previous step's gradients, so the step used their sum.")
            out.append(self.make(step, msg, 1.0, 0.0, comp.name or "optimizer", ["unambiguous"]))
        return out


class AccumulationReset(Rule):
    """Fires when gradients were reset between the backward passes of one optimizer step (the
    ``zerograd`` probe's ``grad/accum_reset`` == 1): every pass but the last was thrown away, so
    each update used a fraction of the batch. Exact, no patience: ``step`` is the optimizer step
    whose window lost gradients; ``where`` the component. ``info`` when that step's model input
    asked for its own gradient (``input_grad``: adversarial training's extra pass)."""

    kind = "accumulation_reset"
    hint = ("Gradients were zeroed inside the accumulation window. Zero them only after the optimizer step: with "
            "accelerate, call the prepared optimizer's optimizer.zero_grad() (it waits for the sync step) instead of "
            "model.zero_grad(); in a hand-written loop, move zero_grad() under the `if (i + 1) % accum == 0` branch.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp, step, n in flagged(record, components, "grad/accum_reset", "grad/accum_check"):
            msg = (f"gradients were reset between the {n} backward passes of optimizer step {step}: only the last "
                   f"pass's gradients reached the update.")
            evidence = ["unambiguous"]
            if record.tables.get(comp.key("grad/accum_check"), {}).get("input_grad"):
                msg += (" The model's input in that step asked for its own gradient (adversarial examples, saliency):"
                        " if that pass was for the input, zeroing the parameters' gradients after it is right.")
                evidence = []  # a finding, not an alarm: the usual adversarial-training loop looks exactly like this
            out.append(self.make(step, msg, 1.0, 0.0, comp.name or "optimizer", evidence))
        return out


class GradsWiped(Rule):
    """Fires when the optimizer stepped on gradients wiped after the backward pass at ``patience`` (3)
    steps in a row (the run in ``grad/wiped``, from the grads probe): the backward pass
    left a non-zero gradient and the optimizer found zero or ``None`` (``clip_grad_norm_`` with
    ``max_norm=0``, a ``zero_grad()`` between ``backward()`` and ``step()``). The pre-clip norm
    looks healthy and the loss simply stops moving. ``unambiguous`` and ``persistent``; ``step`` is
    the first such step, ``where`` the component."""

    kind = "grads_wiped"
    hint = ("Something zeroes the gradients between loss.backward() and optimizer.step(): a clip_grad_norm_ "
            "with max_norm=0 (a config default turned to 0?), optimizer.zero_grad() or model.zero_grad() placed "
            "after backward(), a hook or a gradient mask that multiplies by 0.")

    def __init__(self, *, patience: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience = max(1, patience)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            meta = record.tables.get(comp.key("grad/wiped"), {})
            run = int(meta.get("run", 0))
            if run < self.patience:
                continue
            first = int(meta["first"])
            msg = (f"the optimizer stepped on gradients wiped after the backward pass at {run} steps in a row (from step "
                   f"{first}): the backward pass left non-zero gradients, the optimizer found zeros, so the weights do "
                   f"not learn.")
            out.append(self.make(first, msg, float(run), float(self.patience), comp.name or "optimizer",
                                 ["unambiguous", "persistent"]))
        return out

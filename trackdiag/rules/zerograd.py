"""``grads_not_zeroed``: the optimizer stepped on gradients still holding the previous step's values."""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule

#: the probe's "near" distance in steps (``trackdiag.probes.zerograd.NEAR``: rules do not import probes)
NEAR = 2


class Flagged(NamedTuple):
    comp: Component
    step: int  # the first failing optimizer step of the incident
    backwards: int  # that step's backward passes
    habit: bool  # more than one step failed; else a one-off (the next record came clean)
    meta: dict[str, float]  # the probe's table for that step


#: what a single failing step usually is, in loops that are right
ONE_OFF = ("Once is what an interrupted and resumed step (Ctrl-C in a notebook), an out-of-memory retry or a skipped "
           "batch leaves behind; a loop with the mistake does it at every step, and is then reported as critical.")


class _Habit(Rule):
    """A failing step is judged once it is known whether the loop does it again within ``NEAR`` (2)
    steps: at once when two failing steps of the record's window are that close (``near`` in the
    probe's table), else at the next record that has a verdict for the component (its first failing
    step that close to the last one of before: a habit, reported from the first step; else a one-off),
    or at the run's end (a one-off). While a lone step waits, the session logs every step
    (``follow_until``), so the verdict comes ``NEAR`` steps later at most. One-offs now and then (a
    notebook interrupted twice in a run) stay one-offs, however long the logging window."""

    flag = table = ""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._held: dict[str, tuple[int, int, dict[str, float]]] = {}  # component -> a lone failing step, waiting
        self._habit: dict[str, int] = {}  # component -> the last failing step of a habit

    def _flagged(self, record: Record, components: Sequence[Component]) -> list[Flagged]:
        out = []
        for comp in components:
            value = record.scalars.get(comp.key(self.flag))
            if value is None:  # no verdict in this record: what waits goes on waiting
                continue
            held = self._held.pop(comp.name, None)  # (the last failing step, its passes, its table)
            if value < 0.5:
                if held is not None and record.step - held[0] < NEAR:
                    self._held[comp.name] = held  # clean so far, but not yet NEAR steps on
                elif held is not None:
                    out.append(Flagged(comp, *held[:2], False, held[2]))
                continue
            meta = record.tables.get(comp.key(self.table), {})
            step, backwards = int(meta.get("step", record.step)), int(meta.get("backwards", 0))
            last = int(meta.get("last", step))
            going = self._habit.get(comp.name)
            if going is not None and step - going <= NEAR:  # the habit goes on (folded into its incident)
                self._habit[comp.name] = last
                out.append(Flagged(comp, step, backwards, True, meta))
            elif held is not None and step - held[0] <= NEAR:  # it went on into this window
                self._habit[comp.name] = last
                out.append(Flagged(comp, *held[:2], True, held[2]))
            else:
                if held is not None:
                    out.append(Flagged(comp, *held[:2], False, held[2]))
                if meta.get("near", 0.0) >= 0.5:
                    self._habit[comp.name] = last
                    out.append(Flagged(comp, step, backwards, True, meta))
                    continue
                if last != step:  # lone failing steps far apart within the window: the first told now
                    out.append(Flagged(comp, step, backwards, False, meta))
                self._held[comp.name] = (last, backwards, {**meta, "step": float(last)})  # the last waits
        # the session logs every step until the lone steps are NEAR steps old: the verdict comes at once
        self.follow_until = max((h[0] + NEAR for h in self._held.values()), default=-1)
        return out

    def _alerts(self, found: list[Flagged]) -> list[Alert]:
        return []

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._alerts(self._flagged(record, components))

    def at_close(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        by_name = {c.name: c for c in components}
        held, self._held = self._held, {}
        return self._alerts([Flagged(by_name[n], step, b, False, meta) for n, (step, b, meta) in held.items()
                             if n in by_name])


class GradsNotZeroed(_Habit):
    """Fires when the ``zerograd`` probe saw no gradient reset between two optimizer steps
    (``diag/grad/not_zeroed`` == 1). Exact: ``step`` is the optimizer step that used the accumulated
    gradients; ``where`` the component (``""`` for one model). ``critical`` once a second step failed
    (see ``_Habit``); a single one is an ``info`` finding (see ``ONE_OFF``)."""

    kind = "grads_not_zeroed"
    hint = ("Call optimizer.zero_grad(set_to_none=True) once per optimizer step (after optimizer.step(), or before "
            "the next backward). To accumulate over micro-batches, zero only after each optimizer step; if you "
            "deliberately carry gradients across k optimizer steps, set diag.probes.zerograd.accumulation_steps=k (Python: probes={'zerograd': {'accumulation_steps': k}}).")

    flag, table = "grad/not_zeroed", "grad/zero_check"

    def _alerts(self, found: list[Flagged]) -> list[Alert]:
        out = []
        for comp, step, n, habit, _ in found:
            msg = (f"gradients were not zeroed before optimizer step {step}: after {n} backward pass(es) they still "
                   f"held the previous step's gradients, so the step used their sum")
            msg += (", and again at later steps." if habit else f" (one step so far). {ONE_OFF}")
            out.append(self.make(step, msg, 1.0, 0.0, comp.name or "optimizer",
                                 ["unambiguous", "persistent"] if habit else []))
        return out


class AccumulationReset(_Habit):
    """Fires when gradients were reset between the backward passes of one optimizer step (the
    ``zerograd`` probe's ``grad/accum_reset`` == 1): every pass but the last was thrown away, so
    each update used a fraction of the batch. Exact: ``step`` is the optimizer step whose window lost
    gradients; ``where`` the component. ``critical`` once a second step lost gradients (see
    ``_Habit``); a single one is an ``info`` finding (see ``ONE_OFF``), and so is a step whose
    model input asked for its own gradient (``input_grad``: adversarial training's extra pass)."""

    kind = "accumulation_reset"
    hint = ("Gradients were zeroed inside the accumulation window. Zero them only after the optimizer step: with "
            "accelerate, call the prepared optimizer's optimizer.zero_grad() (it waits for the sync step) instead of "
            "model.zero_grad(); in a hand-written loop, move zero_grad() under the `if (i + 1) % accum == 0` branch.")

    flag, table = "grad/accum_reset", "grad/accum_check"

    def _alerts(self, found: list[Flagged]) -> list[Alert]:
        out = []
        for comp, step, n, habit, meta in found:
            msg = (f"gradients were reset between the {n} backward passes of optimizer step {step}: only the last "
                   f"pass's gradients reached the update")
            msg += (", and again at later steps." if habit else f" (one step so far). {ONE_OFF}")
            evidence = ["unambiguous", "persistent"] if habit else []
            if meta.get("input_grad"):
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

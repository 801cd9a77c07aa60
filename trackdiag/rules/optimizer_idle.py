"""``optimizer_idle``: backward passes keep reaching a model whose optimizer no longer steps.

The gradients are there, every norm looks healthy, and the weights never change: ``optimizer.step()`` is no longer
reached (a gradient-accumulation condition that never holds, such as ``i % accum == accum``, a ``step()`` moved under
a branch, a ``scheduler.step()`` where ``optimizer.step()`` was meant). Read from the grads probe's ``opt/unstepped``
run, which leaves out the steps a ``GradScaler`` skipped. ``stale_params`` says the same at ``advanced`` 50 steps
later; this rule says it at every preset after ``span`` steps.
"""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


class OptimizerIdle(Rule):
    """Fires when a backward pass reached a component at each of ``span`` (10) steps in a row and none of its
    optimizers stepped, after it had been stepping: the run is longer than ``rhythm`` (3) x the longest such run that
    ended in a step before (a loop that gives ``step()`` every micro-batch of an accumulation of k steps each k-th
    one). From the component's first step only after ``from_start`` (50) steps and while no component's optimizer has
    stepped (a generator whose optimizer starts after a critic's warm-up is not this). ``unambiguous`` and
    ``persistent``; ``step`` is the first step without an optimizer step, ``where`` the component. Once per run."""

    kind = "optimizer_idle"
    hint = ("Call optimizer.step() (scaler.step(optimizer) under AMP) after the backward pass of every optimizer step. "
            "Check the gradient-accumulation condition (`(i + 1) % accum == 0` with a counter that keeps counting; "
            "`i % accum == accum` never holds) and that step() was not moved under a branch that stopped running, nor "
            "replaced by scheduler.step().")

    def __init__(self, *, span: int = 10, rhythm: float = 3.0, from_start: int = 50, **kw: Any) -> None:
        super().__init__(**kw)
        self.span, self.rhythm, self.from_start = max(2, span), rhythm, max(2, from_start)
        self._fired: dict[str, int] = {}  # per component: the first step of the run already raised

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            idle = record.tables.get(comp.key("opt/unstepped"))
            if not idle:
                continue
            first, run, gap = int(idle["first"]), int(idle["run"]), int(idle["gap"])
            if self._fired.get(comp.name) == first:
                continue
            start = bool(idle.get("from_start"))
            if start and (run < self.from_start or idle.get("others_step")):
                continue
            if not start and (run < self.span or run <= self.rhythm * gap):
                continue
            self._fired[comp.name] = first
            what = f"component {comp.name!r}" if comp.name else "the model"
            before = ("it has never stepped" if start else
                      "before that it stepped at every step" if gap == 0 else
                      f"before that it stepped at least every {gap + 1} steps")
            msg = (f"backward passes reach {what} at every step, but its optimizer has not stepped since step {first} "
                   f"({run} steps; {before}): its weights do not change. optimizer.step() is "
                   f"{'never' if start else 'no longer'} reached.")
            out.append(self.make(first, msg, float(run), float(max(self.span, self.rhythm * gap)),
                                 comp.name or "optimizer", ["unambiguous", "persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"fired": dict(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = dict(state.get("fired", {}))

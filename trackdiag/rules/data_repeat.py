"""``same_batch``: the training batch did not change for many steps in a row (keys of the ``data_repeat`` probe)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


class SameBatch(Rule):
    """Fires when ``patience`` (8) consecutive steps got a batch with the same contents as the step before
    (``diag/data/repeat_streak``), each a new tensor: a loader restarted every step (``next(iter(loader))``
    inside the loop on an unshuffled loader), a cached batch copied into the input buffer, a sampler that
    returns one index. A batch passed as the very same tensor object every step (full-batch training) is held
    data, not counted by the probe. ``step`` is the first step the repeated batch was seen at; ``persistent``
    (a warning). Fires again only after the batch changed."""

    kind = "same_batch"
    hint = ("The model sees one batch over and over. Create the iterator once outside the loop (it = iter(loader); "
            "batch = next(it), or `for batch in loader`), shuffle the training loader, and check that the batch "
            "variable is reassigned each step. Full-batch training on purpose: pass the same tensor object each step.")

    def __init__(self, *, patience: int = 8, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience = max(1, patience)
        self._fired_start = -2

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        streak = record.scalars.get("diag/data/repeat_streak", 0.0)
        start = int(record.scalars.get("diag/data/repeat_first_step", -1.0))
        if streak < self.patience or start < 0 or start == self._fired_start:
            return []
        self._fired_start = start
        msg = (f"the training batch passed to step() had the same contents at {int(streak) + 1} consecutive steps "
               f"from step {start} (a new tensor each step with identical values: a loader restarted every step, "
               f"not full-batch data held in memory).")
        return [self.make(start, msg, streak, self.patience, "input batch", ["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired_start": self._fired_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired_start = int(state.get("fired_start", -2))

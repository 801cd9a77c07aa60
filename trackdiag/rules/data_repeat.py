"""``same_batch``: the training batch did not change for many steps in a row; ``eval_on_train_batch``: the evaluation
batch is a training batch (keys of the ``data_repeat`` probe)."""
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


class EvalOnTrainBatch(Rule):
    """Fires at a ``log_eval(batch=...)`` whose evaluation batch has the contents of one of the recent training
    batches (``diag/data/eval_train_step`` >= 0, from the ``data_repeat`` probe's fingerprints: same shape, same
    sum and position-weighted sum): the validation loader built on the training split, the training batch
    variable reused in the evaluation loop. The validation metrics then measure fit, not generalisation.
    ``step`` is the evaluation's step; ``corroborated`` (two independent fingerprints and the shape agree: a
    warning). Once per run."""

    kind = "eval_on_train_batch"
    hint = ("The evaluation batch is one the model trained on. Build the validation loader from the held-out split "
            "(not the training dataset or its loader), and in the evaluation loop use the evaluation batch's own "
            "variables, not the training loop's `x, y`.")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fired = False

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        seen = int(record.scalars.get("diag/data/eval_train_step", -1.0))
        if seen < 0 or self._fired:
            return []
        self._fired = True
        msg = (f"the batch passed to log_eval() at step {record.step} has the same contents as the training batch of "
               f"step {seen}: the evaluation measures data the model trained on.")
        return [self.make(record.step, msg, float(seen), -1.0, "eval batch", ["corroborated"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))

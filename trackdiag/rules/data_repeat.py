"""``same_batch``: the training batch did not change for many steps in a row; ``repeated_batches``: each batch arrives
twice or more in a row; ``eval_on_train_batch``: the evaluation batch is a training batch (keys of the ``data_repeat``
probe)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


def rollout_epochs(rule: Rule, components: Sequence[Component]) -> bool:
    """Whether every component is judged as an RL objective (``objective="rl"``): there a batch that repeats is the
    algorithm's (PPO and its kin train several epochs on each rollout), so a repeat is told, not warned about."""
    return bool(components) and all(rule.objectives.of(c.name) == "rl" for c in components)


RL_NOTE = (" Under objective=\"rl\" this is what several epochs over each rollout do (PPO): information, not a "
           "warning; a replay buffer or loader that hands the same batch each step is the bug to look for.")


class SameBatch(Rule):
    """Fires when ``patience`` (8) consecutive steps got a batch with the same contents as the step before
    (``diag/data/repeat_streak``), each a new tensor: a loader restarted every step (``next(iter(loader))``
    inside the loop on an unshuffled loader), a cached batch copied into the input buffer, a sampler that
    returns one index. A batch passed as the very same tensor object every step (full-batch training) is held
    data, not counted by the probe. ``step`` is the first step the repeated batch was seen at; ``persistent``
    (a warning; information under ``objective="rl"``, whose rollouts are trained on for several epochs). Fires again
    only after the batch changed. Not while the model input is one value everywhere: a batch
    of zeros repeats because of it (``constant_inputs`` names that)."""

    kind = "same_batch"
    hint = ("The model sees one batch over and over. Create the iterator once outside the loop (it = iter(loader); "
            "batch = next(it), or `for batch in loader`), shuffle the training loader, and check that the batch "
            "variable is reassigned each step; a torch.manual_seed / np.random.seed call inside the loop replays the "
            "same random indices every step (seed once, before it). Full-batch training on purpose: convert the data "
            "once, before the loop (torch.tensor(array), .float(), .to(device) inside it make a new copy each step), "
            "and pass that tensor each step; an RL loop's epochs over one rollout (PPO): objective=\"rl\".")

    def __init__(self, *, patience: int = 8, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience = max(1, patience)
        self._fired_start = -2

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        streak = record.scalars.get("diag/data/repeat_streak", 0.0)
        start = int(record.scalars.get("diag/data/repeat_first_step", -1.0))
        if streak < self.patience or start < 0 or start == self._fired_start:
            return []
        if record.scalars.get("diag/data/inputs_constant_steps", 0.0) > 0:
            return []  # a batch of one value everywhere repeats because of it: constant_inputs names the cause
        self._fired_start = start
        rl = rollout_epochs(self, components)
        msg = (f"the training batch passed to step() had the same contents at {int(streak) + 1} consecutive steps "
               f"from step {start} (a new tensor each step with identical values: a loader restarted every step, or "
               f"full-batch data converted anew from its array each step).{RL_NOTE if rl else ''}")
        return [self.make(start, msg, streak, self.patience, "input batch", [] if rl else ["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired_start": self._fired_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired_start = int(state.get("fired_start", -2))


class RepeatedBatches(Rule):
    """Fires when, over the last ``min_steps`` (32) or more judged steps, at least ``share`` (40 %) got the contents of
    the step before in a new tensor, with no streak long enough for ``same_batch``: every batch arrives 2-3 times in a
    row. The classic cause: an ``IterableDataset`` read by ``num_workers`` DataLoader workers, each yielding the whole
    stream (no sharding by ``get_worker_info()``), so the loader interleaves identical copies; also a batch list
    extended with itself, a sampler repeating each index. ``step``: the first step of the judged span;
    ``persistent`` (a warning; information under ``objective="rl"``: PPO's epochs over a rollout repeat its batches).
    Once per run."""

    kind = "repeated_batches"
    hint = ("Each batch reaches the model twice or more in a row: the run trains on 1/k of the data it seems to. With an "
            "IterableDataset and num_workers > 1, shard the stream per worker in __iter__ (torch.utils.data."
            "get_worker_info(): skip items so worker i yields every num_workers-th, or split the files), or use a "
            "map-style Dataset; otherwise check for a batch list or sampler that repeats its items. An RL loop that "
            "trains several epochs on each rollout (PPO) repeats them by design: pass objective=\"rl\".")

    def __init__(self, *, share: float = 0.4, min_steps: int = 32, **kw: Any) -> None:
        super().__init__(**kw)
        self.share, self.min_steps = share, max(2, min_steps)
        self._span: list[tuple[int, float, float, float]] = []  # (step, judged, repeats, streak) per record
        self._fired = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        judged = record.scalars.get("diag/data/repeat_judged", 0.0)
        if self._fired or not judged:
            return []
        share = record.scalars.get("diag/data/repeat_share", 0.0)
        self._span.append((record.step, judged, share * judged, record.scalars.get("diag/data/repeat_streak", 0.0)))
        while len(self._span) > 1 and sum(j for _, j, _, _ in self._span[1:]) >= self.min_steps:
            self._span.pop(0)  # keep the shortest recent span of at least min_steps judged steps
        total = sum(j for _, j, _, _ in self._span)
        repeats = sum(r for _, _, r, _ in self._span)
        longest = max(s for *_, s in self._span)
        if total < self.min_steps or repeats < self.share * total or longest >= 8:
            return []  # a long streak is same_batch's
        self._fired = True
        copies = 1.0 / max(1e-9, 1.0 - repeats / total)
        start = self._span[0][0]
        rl = rollout_epochs(self, components)
        msg = (f"{int(repeats)} of the {int(total)} steps up to step {record.step} got the same batch contents as the "
               f"step before, each a new tensor, in short runs (the longest {int(longest) + 1} steps): every batch "
               f"arrives ~{copies:.1f} times in a row, as when {round(copies)} DataLoader workers each read the whole "
               f"stream of an IterableDataset.{RL_NOTE if rl else ''}")
        return [self.make(start, msg, repeats / total, self.share, "input batch", [] if rl else ["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired, "span": self._span}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))
        self._span = [tuple(x) for x in state.get("span", [])]


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

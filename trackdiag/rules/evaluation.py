"""Evaluation that disagrees with training (from ``log_eval``): ``eval_mismatch`` and ``eval_frozen``.

Both judge ``diag/eval/*`` against the newest smoothed train loss (``diag/loss/ema``) of the logging records.
Overfitting (a validation loss that drifts away from a falling train loss) is ``overfitting``'s, not theirs."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import VANISHED_LR, Rule, loss_series
from trackdiag.rules.generalization import latest_train_loss

_SATURATED = (0.0, 1.0, 100.0)  # a loss of 0, an accuracy of 0 / 1 / 100 %: a score that may stay put


def _batch_size(history: Sequence[Record]) -> float:
    """The newest ``diag/data/batch_size`` (the ``data_repeat`` probe's), or nan."""
    for rec in reversed(history):
        if "diag/data/batch_size" in rec.scalars:
            return rec.scalars["diag/data/batch_size"]
    return math.nan


def recent_train_loss(history: Sequence[Record]) -> float:
    """The median of the per-step train loss in the newest record that has one (the model's own, or the only
    component's), or nan: the level now, without the EMA's memory of earlier, higher losses."""
    for rec in reversed(history):
        series = loss_series(rec)
        pts = series.get("diag/loss") or (next(iter(series.values())) if len(series) == 1 else None)
        vals = sorted(v for _, v in pts or () if math.isfinite(v))
        if vals:
            return vals[len(vals) // 2]
        if series:
            return math.nan
    return math.nan


class EvalMismatch(Rule):
    """Fires when the evaluation loss disagrees with the concurrent train loss in one of two ways:

    - **scale**: it is ``factor`` (30) times above or below it (the smoothed ``loss/ema`` and the newest window's
      median alike) at every evaluation since the first, at least ``patience`` (2) of them (a scale that never
      agreed: ``reduction='sum'`` on one side, another split or its preprocessing, a model evaluated in the wrong
      mode from the start);
    - **jump**: each of the newest ``patience`` evaluations sits ``jump`` (3) times above the evaluation before
      them and twice above the train loss, while the train loss (its EMA and its newest window's median) stayed
      within 2x of its value then (weights swapped for a fresh or stale copy, the mode or the split changed from
      then on); the evaluations judged span ``MIN_SPAN`` (10) steps, so a loop evaluating every step has the train
      losses of a logging step between them (a learning rate blown up shows in the evaluation one step first).

    A gap that grows by degrees while the train loss falls is overfitting, left to that rule. ``persistent``: a
    warning; ``info`` when the train loss is ~``batch size`` times the evaluation loss from the start (a train
    loss summed over the batch compared with a per-sample evaluation: the script's own convention, as PyTorch's
    VAE example logs). ``step``: the first evaluation out of line. Once per episode (again after one back in line)."""

    kind = "eval_mismatch"
    hint = ("Evaluation and training measure different things: call model.eval() for evaluation and model.train() "
            "after it; evaluate the model being trained (not a fresh copy, a stale checkpoint or weights not yet "
            "loaded); use the same loss reduction (mean vs sum) and normalisation on both; check the split and its "
            "preprocessing (scaling, tokenisation, label mapping).")

    #: the jump's evaluations span at least this many steps (a logging step's train losses between them)
    MIN_SPAN = 10

    def __init__(self, *, factor: float = 30.0, jump: float = 3.0, patience: int = 2, metric: str = "loss",
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.jump, self.patience, self.metric = factor, jump, max(1, patience), metric
        # (step, val, train EMA, side: -1 below, 0 in line, 1 above, the train loss's newest window median)
        self._evals: list[tuple[int, float, float, int, float]] = []
        self._active = False

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        """Emits at most one finding per episode; costs a scan of the newest records for the train loss."""
        val = record.scalars.get(f"diag/eval/{self.metric}")
        train = latest_train_loss(history)
        if val is None or not (math.isfinite(val) and math.isfinite(train)) or val <= 0 or train <= 0 \
                or not self.minimised(""):
            return []
        ratio = val / train
        now = recent_train_loss(history)
        now_ratio = val / now if math.isfinite(now) and now > 0 else ratio  # a phase's new loss, before the EMA follows
        scale = 1 if min(ratio, now_ratio) >= self.factor else -1 if max(ratio, now_ratio) <= 1 / self.factor else 0
        self._evals.append((record.step, val, train, scale, now if math.isfinite(now) and now > 0 else train))
        del self._evals[:-100]
        from_start = len(self._evals) >= self.patience and all(e[3] == scale != 0 for e in self._evals)
        jumped = 0 if from_start else self._jumped()
        side = scale if from_start else 1 if jumped else 0
        if side == 0 or self._active:
            self._active = side != 0
            return []
        self._active = True
        first = 0 if from_start else len(self._evals) - jumped
        onset, how = self._evals[first][0], "above" if side > 0 else "below"
        if from_start:
            msg = (f"the evaluation {self.metric} {val:.4g} is {max(ratio, 1 / ratio):.0f}x {how} the train loss "
                   f"{train:.4g} (EMA), at every evaluation since the first (step {onset}).")
        else:
            before = self._evals[first - 1]
            msg = (f"the evaluation {self.metric} jumped from {before[1]:.4g} (step {before[0]}) to "
                   f"{self._evals[first][1]:.4g} (step {onset}) and stays there ({val:.4g} now) while the train loss "
                   f"(EMA) went from {before[2]:.4g} to {train:.4g}.")
        bsz = _batch_size(history)
        if from_start and side < 0 and bsz >= 2 and bsz / 3 <= 1 / ratio <= 3 * bsz:
            msg += (f" The train loss is ~{1 / ratio:.0f}x the evaluation loss with batches of {int(bsz)}: a train "
                    "loss "
                    "summed over the batch (reduction='sum') compared with a per-sample evaluation; the runs agree "
                    "once both are per sample.")
            return [self.make(onset, msg, ratio, 1 / self.factor, f"eval/{self.metric}", [])]
        return [self.make(onset, msg, ratio, self.factor if side > 0 else 1 / self.factor, f"eval/{self.metric}",
                          ["persistent"])]

    def _jumped(self) -> int:
        """How many of the newest evaluations jumped (0: none): the newest ``patience`` (or more, to span ``MIN_SPAN``
        steps) all sit ``jump`` times above the evaluation just before them and at least twice above the train loss, while the train loss stayed within 2x of its value then (a drop is
        no fault: an EMA model catching up, a learning-rate decay; nor a validation loss near 0 that jumps by
        factors and stays below the train loss)."""
        k = self.patience  # and as many more as span MIN_SPAN steps: a loop evaluating every step waits for a
        while k < len(self._evals) and self._evals[-1][0] - self._evals[-k][0] < self.MIN_SPAN:  # train loss logged since
            k += 1
        if len(self._evals) <= k or self._evals[-1][0] - self._evals[-k][0] < self.MIN_SPAN:
            return 0
        _, ref_val, ref_train, _, ref_now = self._evals[-1 - k]
        held = all(v / ref_val >= self.jump and v >= 2.0 * t and 0.5 <= t / ref_train <= 2.0 and 0.5 <= n / ref_now <= 2.0
                   for _, v, t, _, n in self._evals[-k:])
        return k if held else 0

    def state_dict(self) -> dict[str, Any]:
        return {"evals": [list(e) for e in self._evals], "active": self._active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._evals = [tuple(e) for e in state.get("evals", [])]  # type: ignore[misc]
        self._active = bool(state.get("active", False))


class EvalFrozen(Rule):
    """Fires when an evaluation value (``diag/eval/<name>``) is bit-for-bit the same at ``patience`` (4)
    evaluations in a row spanning at least ``min_span`` (20) steps while the train loss moved by more than
    ``min_move`` (10 %) over them (the median of the newest window's per-step losses, not the EMA, which still
    moves after the loss stopped): the metric is not recomputed (a variable never updated, a cached result),
    or it is computed on a model copy that does not train. Judged for a loss (a loss of a model that trains
    never repeats to the last bit), and for any other value only when every value of the evaluation is frozen
    (an accuracy on a few hundred samples legitimately holds a value while the loss falls). Scores at 0, 1 or
    100 (saturated) are left alone. ``persistent``: a warning. ``step``: the first evaluation of the run; once
    per run of equal values and metric."""

    kind = "eval_frozen"
    hint = ("The evaluation does not follow training: recompute the metric each evaluation (reset the accumulator, "
            "assign the variable you log), evaluate the model being trained (not a copy made before training or "
            "a checkpoint that is never reloaded), and log the value of this evaluation, not a stored best.")

    def __init__(self, *, patience: int = 4, min_span: int = 20, min_move: float = 0.1, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_span, self.min_move = max(2, patience), min_span, min_move
        self._runs: dict[str, list[float]] = {}  # key -> [value, first step, last step, count, train at first, fired]
        self._lr_peak = 0.0  # the largest learning rate the training records showed

    def _model_still(self, history: Sequence[Record]) -> bool:
        """Whether every learning rate of the newest training record is under 1e-4 of the largest one seen: the model
        no longer changes (a vanished rate, ``lr_vanished``), so an evaluation that repeats to the last bit is right."""
        last = next((r for r in reversed(history) if any("opt/lr" in k for k in r.scalars)), None)
        if last is None:
            return False
        lrs = [v for k, v in last.scalars.items() if "opt/lr" in k and math.isfinite(v)]
        self._lr_peak = max([self._lr_peak, *lrs])
        return bool(lrs) and max(lrs) < VANISHED_LR * self._lr_peak

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        """Emits one finding per frozen metric run; costs a dict update per evaluation value and a median of
        the newest window's losses."""
        train = recent_train_loss(history)
        still = self._model_still(history)
        keys = [k for k, v in record.scalars.items() if k.startswith("diag/eval/") and math.isfinite(v)]
        for key in keys:
            v, run = record.scalars[key], self._runs.get(key)
            if run is None or run[0] != v:
                self._runs[key] = [v, record.step, record.step, 1, train, 0.0]
            elif record.step > run[2]:
                run[2], run[3] = record.step, run[3] + 1
        frozen = [k for k in keys
                  if self._runs[k][3] >= self.patience and self._runs[k][2] - self._runs[k][1] >= self.min_span]
        out = []
        for key in frozen:
            run = self._runs[key]
            moved = math.isfinite(train) and math.isfinite(run[4]) and run[4] > 0 and train > 0 \
                and abs(math.log(train / run[4])) > math.log1p(self.min_move)
            judged = "loss" in key.rsplit("/", 1)[-1] or len(frozen) == len(keys)
            if run[5] or not moved or not judged or run[0] in _SATURATED or still:
                continue
            run[5] = 1.0
            name = key[len("diag/eval/"):]
            msg = (f"evaluation {name} is exactly {run[0]:.6g} at {int(run[3])} evaluations from step {int(run[1])} to "
                   f"{int(run[2])} while the train loss moved from {run[4]:.4g} to {train:.4g}.")
            out.append(self.make(int(run[1]), msg, run[0], run[0], f"eval/{name}", ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"runs": {k: list(r) for k, r in self._runs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._runs = {k: list(r) for k, r in state.get("runs", {}).items()}

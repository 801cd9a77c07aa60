"""Generalisation rules: ``overfitting`` (from ``log_eval``) and ``plateau`` (eval and train loss)."""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule, where_of

_TRAIN_EMA = "diag/loss/ema"


def latest_train_loss(history: Sequence[Record]) -> float:
    """The newest smoothed train loss in ``history``: ``diag/loss/ema``, else the only
    ``diag/<c>/loss/ema`` of a record; ``nan`` when there is none (or several components)."""
    for rec in reversed(history):
        if _TRAIN_EMA in rec.scalars:
            return rec.scalars[_TRAIN_EMA]
        emas = [v for k, v in rec.scalars.items() if k.endswith("/loss/ema")]
        if len(emas) == 1:
            return emas[0]
        if emas:
            return math.nan
    return math.nan


class Overfitting(Rule):
    """Fires at an evaluation where, together:

    - the validation/train loss ratio exceeds ``ratio`` (2.0, the guides' "severe overfitting"); the
      train loss is the newest ``diag/loss/ema`` of the logging records;
    - the gap (val - train) grew over the last ``patience`` (3) evaluations;
    - the validation loss is above its best so far (it is rising, not merely lagging).

    Fires once per episode (again after the conditions cleared). ``where`` is ``eval/<metric>``.
    """

    kind = "overfitting"
    severity = "warning"
    hint = ("Regularise: dropout (0.3-0.5), weight decay (AdamW 0.01-0.05), data augmentation, more data or a "
            "smaller model; use early stopping on the validation loss and keep the best checkpoint.")

    def __init__(self, *, ratio: float = 2.0, patience: int = 3, metric: str = "loss", **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio, self.patience, self.metric = ratio, max(1, patience), metric
        self._evals: deque[tuple[int, float, float]] = deque(maxlen=self.patience + 1)
        self._best = math.inf
        self._active = False

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        val = record.scalars.get(f"diag/eval/{self.metric}")
        train = latest_train_loss(history)
        if val is None or not math.isfinite(val) or not math.isfinite(train) or train <= 0:
            return []
        self._evals.append((record.step, val, train))
        best, self._best = self._best, min(self._best, val)
        ratio = val / train
        gaps = [v - t for _, v, t in self._evals]
        hit = (len(gaps) > self.patience and ratio > self.ratio and gaps[-1] > gaps[0] and val > best)
        fire, self._active = hit and not self._active, hit
        if not fire:
            return []
        msg = (f"validation {self.metric} {val:.4g} is {ratio:.1f}x the train loss {train:.4g} (gap grew from "
               f"{gaps[0]:.3g} to {gaps[-1]:.3g} over {self.patience} evaluations; best validation {best:.4g}).")
        return [self.make(record.step, msg, ratio, self.ratio, f"eval/{self.metric}")]

    def state_dict(self) -> dict[str, Any]:
        return {"evals": [list(e) for e in self._evals], "best": self._best, "active": self._active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._evals = deque((tuple(e) for e in state.get("evals", [])), maxlen=self.patience + 1)  # type: ignore[misc]
        self._best = float(state.get("best", math.inf))
        self._active = bool(state.get("active", False))


class Plateau(Rule):
    """Fires when a loss stops improving:

    - evaluation: ``diag/eval/<metric>`` has not improved on its best by more than ``min_delta``
      (1e-4) for ``patience`` (10) evaluations (the guides' early-stopping rule);
    - training: the smoothed train loss (``loss/ema``) has not improved on its best by more than
      ``max(min_delta, rel_delta x |best|)`` (``rel_delta`` 0.01) for ``patience_steps`` (1000) steps.

    Fires once per plateau. ``where``: ``eval/<metric>``, or the loss (``loss`` / ``<component>``).
    A converged run plateaus too: the severity is ``info``.
    """

    kind = "plateau"
    severity = "info"
    hint = ("If not converged: raise or lower the LR (check diag/update/ratio_median, ~1e-3 is healthy), use an LR "
            "schedule (ReduceLROnPlateau, warm restarts), look for dead units, vanishing gradients or a frozen "
            "layer; if converged: stop early and keep the best checkpoint.")

    def __init__(self, *, patience: int = 10, min_delta: float = 1e-4, patience_steps: int = 1000,
                 rel_delta: float = 0.01, metric: str = "loss", **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_delta, self.metric = max(1, patience), min_delta, metric
        self.patience_steps, self.rel_delta = max(1, patience_steps), rel_delta
        self._eval = {"best": math.inf, "since": 0, "step": -1}
        self._train: dict[str, dict[str, float]] = {}

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        val = record.scalars.get(f"diag/eval/{self.metric}")
        if val is None or not math.isfinite(val):
            return []
        st = self._eval
        if val < st["best"] - self.min_delta:
            st.update(best=val, since=0, step=record.step)
            return []
        st["since"] += 1
        if st["since"] != self.patience:
            return []
        msg = (f"validation {self.metric} has not improved by more than {self.min_delta:g} for {self.patience} "
               f"evaluations (best {st['best']:.4g} at step {int(st['step'])}, now {val:.4g}).")
        return [self.make(record.step, msg, val, st["best"] - self.min_delta, f"eval/{self.metric}")]

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, v in record.scalars.items():
            if not key.endswith("loss/ema") or not math.isfinite(v):
                continue
            st = self._train.setdefault(key, {"best": math.inf, "step": record.step, "fired": 0.0})
            if v < st["best"] - max(self.min_delta, self.rel_delta * abs(st["best"])) or not math.isfinite(st["best"]):
                st.update(best=v, step=record.step, fired=0.0)
            elif record.step - st["step"] >= self.patience_steps and not st["fired"]:
                st["fired"] = 1.0
                where = where_of(key[: -len("/ema")]) or "loss"
                msg = (f"train loss (EMA {v:.4g}) has not improved by {self.rel_delta:.0%} on its best {st['best']:.4g} "
                       f"(step {int(st['step'])}) for {record.step - int(st['step'])} steps.")
                out.append(self.make(record.step, msg, v, st["best"], where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"eval": dict(self._eval), "train": {k: dict(s) for k, s in self._train.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._eval.update(state.get("eval", {}))
        self._train = {k: dict(s) for k, s in state.get("train", {}).items()}

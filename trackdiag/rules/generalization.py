"""Generalisation: ``overfitting`` (from ``log_eval``); ``plateau`` lives in :mod:`trackdiag.rules.plateau`."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._eval_series import LrRestarts, after_descent, curve_noise, noise_of, recent_train_loss, smoothed_best
from trackdiag.rules.base import Rule
from trackdiag.rules.eval_inputs import input_shift_in

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
    """Fires at an evaluation where the validation loss has turned upward while the train loss
    (the newest ``diag/loss/ema``) did not:

    - **trend**: each of the last ``patience`` (2) evaluations sits above the best validation loss by
      more than ``min_rise`` (5%) of it, ``giveback`` (0: off; a share of the improvement since the
      first evaluation, which counts a step-0 evaluation at chance level) and ``rise_noise`` (3) times
      the scatter around a smooth curve of the evaluations before those judged (:func:`curve_noise`, from the median
      second difference: a steady rise is not scatter; 1.5x the successive changes before, which a noisy
      plateau's lowest reading cleared in ~1 of 12 healthy runs), the newest is ``min_rise`` above the one ``patience``
      evaluations earlier and above the train loss, and the train loss fell meanwhile. A lone low
      reading between two higher ones is not the best (each evaluation counts as the median of it
      and its neighbours): one lucky reading of a noisy validation loss does not make everything
      after it look like a rise;
    - **ratio**: or val/train exceeds ``ratio`` (2.0, the guides' "severe overfitting") with the last
      ``patience`` evaluations above the best (a mere lag behind a fast-falling train loss, or one
      noisy reading, with the validation loss still improving, is not overfitting) and the train loss
      no higher than ``min_rise`` above what it was at the best validation loss (a train loss that rose
      too is new data or a changed objective: a continual-learning task switch, an eval set that grew).
    - **climb**: or the validation loss rose at each of the last ``patience`` evaluations (as many as span ``min_span``
      steps), by more than ``min_rise`` of its best and ``climb_noise`` (4) times that scatter in all
      (:meth:`_climb`), held like the trend (``sustained``), while the train loss now (the median of its newest
      every-step values: the 50-step EMA lags a fast fall) fell over those evaluations and sits below it: a steady
      turn of a few % an evaluation is raised by the second evaluation after it, not when two readings clear 5 %.

    - **gap**: or the validation loss went flat while training keeps fitting (:meth:`_gap`): every evaluation
      within ``min_rise`` (or the later evaluations' noise) of the best for ``2 * min_span`` steps and
      ``patience`` + 1 evaluations, its later half no lower than its first, the train loss ``gap_fall`` (2x)
      lower since the flat stretch began and val/train above ``ratio``; ``step`` is where it began.

    The evaluations' scatter (and the gap's noise, ``noise`` (1.5) times the median successive change) is read after their first falling run (the early descent's steps are trend, not noise).
    The evaluations judged span at least ``min_span`` (20) steps (more of them when the loop evaluates
    more often than that), and the validation loss stayed above the margin for at least ``sustained``
    (half) of the steps since its best: a loop evaluating every step sees a validation loss that
    drifts up and back around a level (a GCN on 60 labelled nodes, ~20 % excursions) as a series of
    short excursions, an overfitting run as one that began at the best and never came back.
    ``step`` is the onset: the evaluation right after the best validation loss. Fires once per
    episode (again once the validation loss came back to within the margin of its best). When the train loss is ~0 while the validation
    loss is many times larger (``leak_ratio``, 20x), the message names label/data leakage as well.
    ``where`` is ``eval/<metric>``. A warm restart of the learning rate (:class:`LrRestarts`: SGDR, a bump after a
    decay) starts the series again from the evaluations ``settle`` (60) steps after it: both losses jump back up and
    the validation loss wanders while the rate is high, by design. Evaluation inputs seen on another scale than the
    training inputs (``eval_input_shift``: the validation data skipped a normalisation) end the rule for the run: a
    validation loss on inputs the model never saw says nothing of fitting.
    """

    kind = "overfitting"
    hint = ("Regularise: dropout (0.3-0.5), weight decay (AdamW 0.01-0.05), data augmentation, more data or a "
            "smaller model; use early stopping on the validation loss and keep the best checkpoint.")

    def __init__(self, *, ratio: float = 2.0, patience: int = 2, min_rise: float = 0.05, giveback: float = 0.0,
                 noise: float = 1.5, leak_ratio: float = 20.0, metric: str = "loss", min_span: int = 20,
                 sustained: float = 0.5, gap_fall: float = 2.0, rise_noise: float = 3.0, climb_noise: float = 4.0,
                 settle: int = 60, **kw: Any) -> None:
        super().__init__(**kw)
        self.settle = settle
        self.gap_fall, self.rise_noise, self.climb_noise = gap_fall, rise_noise, climb_noise
        self.min_span, self.sustained = min_span, sustained
        self.ratio, self.patience, self.metric = ratio, max(1, patience), metric
        self.min_rise, self.giveback, self.noise, self.leak_ratio = min_rise, giveback, noise, leak_ratio
        self._evals: list[tuple[int, float, float, float]] = []  # (step, val, train EMA, train now), bounded
        self._active = False
        self._gap_at = math.inf  # the best validation loss when the gap path last fired
        self._onset = -1  # the onset last said: an episode that ends and resumes from the same best is one
        self._restarts, self._settled = LrRestarts(), -1
        self._shifted = False  # the evaluation inputs were seen on another scale: its losses say nothing of fitting

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        val = record.scalars.get(f"diag/eval/{self.metric}")
        if input_shift_in(record):  # inputs prepared unlike the training ones (eval_input_shift): not overfitting
            self._shifted = True
        if self._shifted:
            return []
        train, train_now = latest_train_loss(history), recent_train_loss(history)
        if val is None or not math.isfinite(val) or not math.isfinite(train) or train <= 0:
            return []
        train_now = train_now if math.isfinite(train_now) else train
        restart = self._restarts.update(history)
        if restart is not None:  # another cycle: its evaluations are judged once the restart has settled
            self._evals, self._active, self._settled = [], False, restart + self.settle
        if record.step < self._settled:
            return []
        self._evals.append((record.step, val, train, train_now))
        del self._evals[:-200]
        vals = [e[1] for e in self._evals]
        best_i = min(range(len(vals)), key=vals.__getitem__)
        best = smoothed_best(vals)
        # the last `patience` evaluations, and as many more as it takes to span `min_span` steps (a loop
        # that evaluates every step gets no verdict from two readings one step apart)
        k = self.patience
        while k < len(self._evals) and self._evals[-1][0] - self._evals[-k][0] < self.min_span:
            k += 1
        recent = vals[-k:]
        # every one of them sits above the best, by a margin that counts what the run gained so far and the
        # scatter of the evaluations before the ones judged (a sharp turn's own kink is not scatter): not a noisy reading
        floor, pre = max(best * self.min_rise, self.giveback * (vals[0] - best)), curve_noise(after_descent(vals[:-k]))
        margin = max(floor, self.rise_noise * pre)
        tail = after_descent(vals)
        scatter = curve_noise(tail)
        spanned = len(recent) >= self.patience and self._evals[-1][0] - self._evals[-len(recent)][0] >= self.min_span
        # the excursion above the best is most of the time since it, not a drift up and back
        held = self._held(vals, best, max(floor, self.noise * pre))  # a noisy climb's start: where it left 1.5x
        above = spanned and min(recent) > best + margin + 1e-12 and held
        trend = False
        if len(self._evals) > k:
            s0, v0, t0, _ = self._evals[-1 - k]
            # a loop that evaluates every few steps: the levels of the last `min_span` steps and of those
            # before them, not two single noisy readings (with sparse evaluations: the readings themselves)
            now, before = self._level(self._evals[-1][0]), self._level(s0)
            trend = above and now > before * (1 + self.min_rise) and train < t0 and val > train
        ratio = val / train
        # a climb is judged against the scatter once there is one to measure (two second differences after the descent)
        climb = held and len(tail) >= 4 and self._climb(vals, max(best * self.min_rise, self.climb_noise * scatter), train_now)
        # overfitting fits the training data better while the validation data gets worse: a train loss that rose
        # since the best validation loss (new data in continual learning, an eval set that grew) is not it
        fitting = train <= self._evals[best_i][2] * (1 + self.min_rise)
        # flat: within ``min_rise`` of the best, or the noise of the later evaluations (early ones are trend)
        level = best + max(best * self.min_rise, self.noise * noise_of(after_descent(vals)))
        gap = self._gap(vals, level, train, ratio) if not (trend or above or climb) else None
        if gap is not None and best > self._gap_at * (1 - self.min_rise):  # said, and nothing learned since
            gap = None
        hit = trend or climb or (above and ratio > self.ratio and fitting) or gap is not None
        fire = hit and not self._active
        # an episode ends when the validation loss is back near its best, not at one softer reading
        self._active = hit or (self._active and val > best + margin)
        if not fire:
            return []
        lowest = min(vals)
        said = f"{best:.4g}" + (f" (each evaluation read as the median of it and its neighbours; the lowest single "
                                f"reading {lowest:.4g})" if f"{lowest:.4g}" != f"{best:.4g}" else "")
        if gap is not None and not trend and not above and not climb:
            onset, since_train = gap
            self._gap_at, self._onset = best, onset
            why = (f"the validation {self.metric} has stayed within {level / best - 1:.0%} of its best {said} since step "
                   f"{onset} while the train loss fell {since_train / train:.1f}x to {train:.4g} ({ratio:.1f}x below it)")
            return [self.make(onset, f"{why}: the model fits its training data and no longer generalises better "
                              f"(flat since step {onset}).", ratio, self.ratio, f"eval/{self.metric}", ["persistent"])]
        onset = self._evals[min(best_i + 1, len(self._evals) - 1)][0]
        if onset == self._onset:
            return []
        self._onset = onset
        why = (f"the validation {self.metric} rose from its best {said} to {val:.4g} while the train loss fell to "
               f"{train:.4g}" if trend or climb else f"validation {self.metric} {val:.4g} is {ratio:.1f}x the train loss {train:.4g} "
               f"and above its best {said}")
        leak = (" The train loss is ~0 while the validation loss is far higher: also check for label/data leakage "
                "(targets visible in the training inputs, duplicates across the split)." if ratio > self.leak_ratio else "")
        return [self.make(onset, f"{why} (rising since step {onset}).{leak}", ratio, self.ratio, f"eval/{self.metric}", ["persistent"])]

    def _gap(self, vals: Sequence[float], level: float, train: float, ratio: float) -> tuple[int, float] | None:
        """The validation loss flat (every evaluation within ``level`` of its best) for at least ``min_span``
        steps and ``patience`` + 1 evaluations while the train loss fell ``gap_fall`` (2x) or more since the
        flat stretch began, and val/train above ``ratio``: (the step it began, the train loss then); else None."""
        if ratio <= self.ratio or level > smoothed_best(vals) * (1 + 2 * self.min_rise):
            return None  # evaluations noisier than 10% of their level: flatness is not judged from a few of them
        # each evaluation as the median of it and its neighbours: one noisy reading does not end the flat stretch
        smooth = [sorted(vals[max(j - 1, 0):j + 2])[len(vals[max(j - 1, 0):j + 2]) // 2] for j in range(len(vals))]
        i = len(vals)
        while i > 0 and smooth[i - 1] <= level:
            i -= 1
        if i == 0 or len(vals) - i < self.patience + 1:  # flat from the first evaluation: nothing was learned first
            return None
        flat, half = vals[i:], (len(vals) - i) // 2
        if statistics.median(flat[half:]) < statistics.median(flat[:half]) * (1 - self.min_rise):
            return None  # still improving through the noise (its later half lower than its first): not flat
        start, _, train0, _ = self._evals[i]
        if self._evals[-1][0] - start < 2 * self.min_span or train0 < self.gap_fall * train:
            return None
        return start, train0

    def _held(self, vals: Sequence[float], best: float, margin: float) -> bool:
        """The validation loss has stayed above ``best + margin`` for at least ``sustained`` (half) of the steps
        since its last reading at the best: one excursion that began there, not a drift up and back."""
        best_at = max(i for i, v in enumerate(vals) if v <= best)  # the last reading at the (smoothed) best
        since = next((i for i in range(len(vals) - 1, best_at, -1) if vals[i] <= best + margin), best_at)
        best_step, left_step, now = self._evals[best_at][0], self._evals[since][0], self._evals[-1][0]
        return now - left_step >= self.sustained * (now - best_step)

    def _climb(self, vals: Sequence[float], rise: float, now: float) -> bool:
        """The validation loss rose at every one of its last ``patience`` (or more: as many as span ``min_span``
        steps) evaluations, by more than ``rise`` in all (``min_rise`` of its best, ``climb_noise`` times its scatter
        around a smooth curve: a steady climb is not noise), while the train loss now (the median of
        its newest every-step values: the EMA lags a fast fall) is below the validation loss and below what it
        was where the climb began."""
        k = self.patience
        while k < len(vals) - 1 and self._evals[-1][0] - self._evals[-1 - k][0] < self.min_span:
            k += 1
        if len(vals) <= k or self._evals[-1][0] - self._evals[-1 - k][0] < self.min_span:
            return False
        climb = vals[-1 - k:]
        if any(b <= a for a, b in zip(climb, climb[1:])):
            return False
        return climb[-1] - climb[0] > rise and now < self._evals[-1 - k][3] and now < vals[-1]

    def _level(self, step: int) -> float:
        """The median of the evaluations in the ``min_span`` steps up to ``step`` (at least the one at it)."""
        window = [e[1] for e in self._evals if step - self.min_span < e[0] <= step]
        return statistics.median(window) if window else math.nan

    def state_dict(self) -> dict[str, Any]:
        return {"evals": [list(e) for e in self._evals], "active": self._active, "gap_at": self._gap_at,
                "onset": self._onset, "shifted": self._shifted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._evals = [tuple(e) if len(e) == 4 else (*e, e[2]) for e in state.get("evals", [])]  # type: ignore[misc]
        self._active = bool(state.get("active", False))
        self._gap_at, self._onset = float(state.get("gap_at", math.inf)), int(state.get("onset", -1))
        self._shifted = bool(state.get("shifted", False))

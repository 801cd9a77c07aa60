"""Readings of an evaluation series for the overfitting rule: the best, the noise around the trend, the
train loss now. Host work on evaluation steps only: a few medians over at most a few hundred floats."""
from __future__ import annotations

import math
import statistics
from typing import Sequence

from trackdiag.core.record import Record


def smoothed_best(vals: Sequence[float]) -> float:
    """The lowest value once each is replaced by the median of it and its two neighbours: a lone
    low reading between two higher ones does not count as the best (the first and the newest
    value, with one neighbour, count as they are)."""
    inner = [sorted(vals[i - 1:i + 2])[1] for i in range(1, len(vals) - 1)]
    return min([vals[0], vals[-1], *inner])


def noise_of(vals: Sequence[float]) -> float:
    """The spread of one value around the trend, from the median absolute successive change
    (robust to a trend and to outliers): ``median|d| / (0.6745 * sqrt 2)``; 0 with fewer than 4."""
    if len(vals) < 4:
        return 0.0
    return statistics.median(abs(b - a) for a, b in zip(vals, vals[1:])) / 0.954


def curve_noise(vals: Sequence[float]) -> float:
    """The spread of one value around a smooth curve, from the median absolute second difference (a steady
    rise or fall cancels out, a reading that jumps does not): ``median|d2| / (0.6745 * sqrt 6)``; 0 with fewer
    than 4 values."""
    if len(vals) < 4:
        return 0.0
    return statistics.median(abs(c - 2 * b + a) for a, b, c in zip(vals, vals[1:], vals[2:])) / 1.652


def after_descent(vals: Sequence[float]) -> Sequence[float]:
    """``vals`` from the end of their first strictly falling run on: the early descent's big steps are trend,
    not the evaluations' noise (a steep fall read as noise hides the turn after it)."""
    i = 0
    while i + 1 < len(vals) and vals[i + 1] < vals[i]:
        i += 1
    return vals[i:]


def recent_train_loss(history: Sequence[Record], steps: int = 10) -> float:
    """The train loss now: the median of its every-step values (series ``diag/loss``, else the only
    ``diag/<c>/loss``) over the newest ``steps`` steps the history holds; ``nan`` when no record carries one.
    The smoothed ``loss/ema`` (a 50-step average) lags a loss that falls fast; this does not."""
    pts: list[float] = []
    for rec in list(history)[-50:][::-1]:  # the newest records only: a loop without every-step series gives up soon
        series = rec.series.get("diag/loss")
        if series is None:
            own = [v for k, v in rec.series.items() if k.endswith("/loss") and k.startswith("diag/")]
            series = own[0] if len(own) == 1 else None
        if series is None:
            if pts:
                break
            continue
        pts = [v for _, v in series if math.isfinite(v)] + pts
        if len(pts) >= steps:
            break
    return statistics.median(pts[-steps:]) if pts else math.nan


class LrRestarts:
    """The last warm restart in the records seen: a learning rate that, after falling to half its run-high or
    lower, rises ``factor`` (2) x or more between two logging steps (SGDR's cosine back to its base rate, a manual
    bump after a decay). A warm-up from a small rate never fell first: no restart. Host work on the records."""

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor
        self._seen, self._prev, self._top = -1, math.nan, 0.0

    def update(self, history: Sequence[Record]) -> int | None:
        """The step of the newest restart among the records after the last call, else None."""
        found = None
        fresh = []
        for rec in reversed(history):  # only the records since the last call, oldest first
            if rec.step <= self._seen:
                break
            fresh.append(rec)
        for rec in reversed(fresh):
            self._seen = rec.step
            lrs = [v for k, v in rec.scalars.items() if "/opt/lr" in k and math.isfinite(v)]
            if not lrs:
                continue
            lr = max(lrs)
            if self._prev > 0 and lr >= self.factor * self._prev and self._prev <= 0.5 * self._top:
                found = rec.step
            self._prev, self._top = lr, max(self._top, lr)
        return found

"""The recent every-step values of a series, for rules that judge a finding by what came after it.

Host work on the logging step only: a bounded deque of ``(step, value)`` per series and a few
medians over slices of it.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Iterable


class Recent:
    """The last ``size`` ``(step, value)`` points of one series, oldest first."""

    def __init__(self, size: int = 512) -> None:
        self.points: deque[tuple[int, float]] = deque(maxlen=size)

    def extend(self, points: Iterable[tuple[int, float]]) -> None:
        last = self.points[-1][0] if self.points else -1
        for s, v in points:
            if s > last:
                self.points.append((s, v))
                last = s

    @property
    def last_step(self) -> int:
        return self.points[-1][0] if self.points else -1

    def between(self, lo: int, hi: int) -> list[float]:
        """Values at steps ``lo <= step <= hi`` (read from the newest end: rules ask about recent steps)."""
        out = []
        for s, v in reversed(self.points):
            if s < lo:
                break
            if s <= hi:
                out.append(v)
        out.reverse()
        return out

    def before(self, step: int, n: int) -> list[float]:
        """The finite values of the last ``n`` points before ``step``."""
        vals = []
        for s, v in reversed(self.points):
            if len(vals) >= n:
                break
            if s < step and math.isfinite(v):
                vals.append(v)
        vals.reverse()
        return vals

    def level(self, step: int, n: int = 20) -> float:
        """The median of the ``n`` finite values before ``step`` (nan without any)."""
        vals = self.before(step, n)
        return statistics.median(vals) if vals else math.nan

    def spread(self, step: int, n: int = 20) -> float:
        """The median absolute deviation of the ``n`` finite values before ``step`` (0 with < 3)."""
        vals = self.before(step, n)
        if len(vals) < 3:
            return 0.0
        mid = statistics.median(vals)
        return statistics.median(abs(v - mid) for v in vals)


def above(v: float, level: float, mad: float, factor: float, mads: float) -> bool:
    """Whether ``v`` sits above ``level`` by ``mads`` median absolute deviations (``mad``) AND by ``factor`` x (for a
    positive level; for a signed series, by the deviations alone)."""
    rise = v - level
    scale_ok = v > factor * level if level > 0 else True
    return rise > mads * max(mad, 1e-12) and scale_ok and rise > 1e-6 * max(abs(level), 1e-12)


def reacted(loss: Recent, step: int, settle: int, factor: float = 1.5, mads: float = 6.0) -> bool:
    """Whether the loss reacted to something that happened at ``step``: within ``step .. step +
    settle`` it went non-finite, or most of those steps (3, or all when fewer) sat above its level
    before ``step`` by ``mads`` median absolute deviations AND by ``factor`` x (for a positive level;
    for a signed loss, by the deviations alone). A loss that rose for a step and came back is no
    reaction: one odd batch perturbs one update."""
    after = loss.between(step, step + settle)
    if any(not math.isfinite(v) for v in after):
        return True
    level, mad = loss.level(step), loss.spread(step)
    if not after or not math.isfinite(level):
        return False

    return sum(above(v, level, mad, factor, mads) for v in after) >= min(3, len(after))

"""A scale-free spike test for an every-step series (the loss, the pre-clip gradient norm).

A value is a spike when it is both far outside the recent spread and many times the recent
level: ``v - mean >= z * std`` over the last ``window`` (128) non-zero values (OLMo-core's test) AND
``v >= factor * max(level, floor)`` (the guides' "10x the recent mean"), where ``level`` is the median
of the last 20 values (the window's mean early in training still holds the first, higher losses)
and ``floor`` is
``floor_fraction`` (0.1) of the series' median over its first ``warmup`` (20) values, so a loss
that has converged near zero does not turn every slightly worse batch into a "10x spike".

Before ``warmup`` values there is no spread to measure: from ``early`` (5) values on, only a jump of
``early_factor`` (100) x the median so far counts (a learning rate of 50 at step 12 of a 30-step
run; no healthy run's norm or loss jumps a hundredfold in its first steps).

Why both: measured on healthy runs of four realistic scripts (1,500 steps), a lone z-score reached
11.5 and a lone ratio 13.7 (a digits CNN near zero loss meeting one misclassified batch), while the
planted learning-rate blow-ups scored z >= 41 and ratio >= 23 on the gradient norm. Host work on
the logging step only: a deque of floats per series and running sums (O(1) per value).
"""
from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from typing import Any


class SpikeDetector:
    """See module docstring. ``feed(v)`` returns ``(is_spike, reference level)``."""

    def __init__(self, *, z: float = 6.0, factor: float = 10.0, window: int = 128, warmup: int = 20,
                 floor_fraction: float = 0.1, level_of: int = 20, early: int = 5, early_factor: float = 100.0) -> None:
        self.z, self.factor, self.warmup, self.floor_fraction = z, factor, max(2, warmup), floor_fraction
        self.early, self.early_factor = early, early_factor
        self.level_of = max(1, level_of)
        self.recent: deque[float] = deque(maxlen=max(window, self.warmup))
        self.first: list[float] = []
        self.floor = 0.0
        self._sum = self._sq = 0.0  # running sums over ``recent``, re-summed now and then against drift
        self._fed = 0

    def feed(self, v: float, level: bool = True) -> tuple[bool, float]:
        """``level=False``: the reference level is only worked out when the z-test passes (nan otherwise);
        the verdict is the same, the median of the last values is not taken for every value."""
        # exactly 0 is "no gradient" (a layer not training yet) or a hinge loss at rest, not a level: a
        # baseline of zeros would make the first real value a "spike"
        if not math.isfinite(v) or v == 0.0:
            return False, math.nan
        spike, ref = False, math.nan
        n = len(self.recent)
        if n >= self.warmup:
            mean = self._sum / n
            std = math.sqrt(max(self._sq / n - mean * mean, 0.0))
            # the level a jump is measured against: the median of the last ``level_of`` values (early in
            # training the window's mean still holds the first, higher losses and hides a 30x jump)
            far = v - mean >= self.z * std
            if far or level:
                ref = max(statistics.median(itertools.islice(reversed(self.recent), self.level_of)), self.floor)
            # ref > 0: a series that sat at exactly 0 (a layer not training yet) has no level to be a multiple of
            spike = far and ref > 0 and v >= self.factor * ref
        elif n >= self.early:
            ref = statistics.median(self.recent)
            spike = ref > 0 and v >= self.early_factor * ref
        if spike:
            return True, ref  # a spike does not join the baseline it is judged against
        if n == self.recent.maxlen:
            old = self.recent[0]
            self._sum -= old
            self._sq -= old * old
        self.recent.append(v)
        self._sum += v
        self._sq += v * v
        self._fed += 1
        if self._fed % 1024 == 0:
            self._sum, self._sq = math.fsum(self.recent), math.fsum(x * x for x in self.recent)
        if len(self.first) < self.warmup:
            self.first.append(v)
            if len(self.first) == self.warmup:
                self.floor = self.floor_fraction * abs(statistics.median(self.first))
        return False, ref

    def state_dict(self) -> dict[str, Any]:
        return {"recent": list(self.recent), "first": list(self.first), "floor": self.floor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.extend(float(v) for v in state.get("recent", []))
        self._sum, self._sq = math.fsum(self.recent), math.fsum(x * x for x in self.recent)
        self.first = [float(v) for v in state.get("first", [])]
        self.floor = float(state.get("floor", 0.0))

"""Schedules are plain ``step -> bool`` callables."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Every:
    """Fires on steps ``0, n, 2n, ...``; with ``anomaly`` also on every step of an anomaly window."""

    n: int
    anomaly: bool = True

    def __call__(self, step: int) -> bool:
        return step % self.n == 0


@dataclass(frozen=True)
class Never:
    """Never fires (a probe that only runs on anomalies or at the end)."""

    def __call__(self, step: int) -> bool:
        return False


@dataclass(frozen=True)
class EarlyThenEvery:
    """Fires on every step below ``early``, then on ``0, n, 2n, ...`` (faults present from the
    first step are measured at once); with ``anomaly`` also on anomaly-window steps."""

    early: int
    n: int
    anomaly: bool = True

    def __call__(self, step: int) -> bool:
        return step < self.early or step % self.n == 0


@dataclass(frozen=True)
class SpreadThenEvery:
    """Fires on step 0, on ``base`` x 1, 2, 5, 10, 20, 50, ... below ``n`` (log-spaced: dense early,
    sparse later), then on every multiple of ``n``. With ``base=10, n=500``: 0, 10, 20, 50, 100, 200,
    500, 1000, 1500, ...: a 300-step run gets 6 measurements, a 100k-step one 206 (``Every(n)``
    plus 5 more). With ``anomaly``, also on anomaly-window steps."""

    n: int
    base: int = 10
    anomaly: bool = True

    def __call__(self, step: int) -> bool:
        if step % self.n == 0:
            return True
        if step > self.n or self.base < 1 or step % self.base:
            return False
        m = step // self.base
        while m % 10 == 0:
            m //= 10
        return m in (1, 2, 5)


@dataclass(frozen=True)
class Strided:
    """``inner``'s steps that are also multiples of ``n`` (the cost budget's longer cadence,
    :mod:`trackdiag.session.budget_policy`); anomaly windows as ``inner``'s."""

    inner: Callable[[int], bool]
    n: int

    @property
    def anomaly(self) -> bool:
        return getattr(self.inner, "anomaly", True)

    def __call__(self, step: int) -> bool:
        return step % self.n == 0 and self.inner(step)

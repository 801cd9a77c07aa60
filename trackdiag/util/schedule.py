"""Schedules are plain ``step -> bool`` callables. :func:`next_due` tells the next step one fires (the step
plan asks it once per logging step, so that a non-logging step calls no schedule at all)."""
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

    def after(self, step: int) -> int:
        return (step // self.n + 1) * self.n


@dataclass(frozen=True)
class Never:
    """Never fires (a probe that only runs on anomalies or at the end)."""

    def __call__(self, step: int) -> bool:
        return False

    def after(self, step: int) -> int:
        return NEVER


@dataclass(frozen=True)
class EarlyThenEvery:
    """Fires on every step below ``early``, then on ``0, n, 2n, ...`` (faults present from the
    first step are measured at once); with ``anomaly`` also on anomaly-window steps."""

    early: int
    n: int
    anomaly: bool = True

    def __call__(self, step: int) -> bool:
        return step < self.early or step % self.n == 0

    def after(self, step: int) -> int:
        return step + 1 if step + 1 < self.early else (step // self.n + 1) * self.n


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

    def after(self, step: int) -> int:
        nxt = (step // self.n + 1) * self.n
        if self.base >= 1 and step < self.n:
            t = (step // self.base + 1) * self.base
            while t < nxt:  # n / base candidates at most
                if self(t):
                    return t
                t += self.base
        return nxt


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

    def after(self, step: int) -> int:
        t = (step // self.n + 1) * self.n  # a multiple of n, the first candidate
        jump = getattr(self.inner, "after", None)
        for _ in range(SCAN):
            if self.inner(t):
                return t
            if jump is None:  # a plain callable: the next multiple of n
                t += self.n
                continue
            nxt = jump(t)  # the inner schedule's next step, then the first multiple of n from it
            if nxt >= NEVER:
                return NEVER
            t = -(-nxt // self.n) * self.n
        return t


#: a step no run reaches
NEVER = 1 << 62
#: how far :func:`next_due` looks ahead for a schedule without an ``after`` (then it asks again there)
SCAN = 1000


def next_due(schedule: Callable[[int], bool], step: int) -> int:
    """The first step after ``step`` that ``schedule`` fires on (anomaly windows aside): its ``after``, else the
    first of the next ``SCAN`` steps it fires on, else the step after them (ask again there). Host work, a
    few calls for the built-in schedules."""
    after = getattr(schedule, "after", None)
    if after is not None:
        return after(step)
    for t in range(step + 1, step + SCAN + 1):
        if schedule(t):
            return t
    return step + SCAN + 1

"""Schedules are plain ``step -> bool`` callables."""
from __future__ import annotations

from dataclasses import dataclass


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

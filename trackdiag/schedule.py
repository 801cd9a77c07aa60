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

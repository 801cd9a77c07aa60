"""Consecutive-observation counters shared by the rules that need a condition to persist."""
from __future__ import annotations

from typing import Any


class Streaks:
    """Per-key count of consecutive observations where a condition held, and the step it began.

    ``bump(key, cond, step, min_span)`` returns True exactly once per streak: at the first observation
    where the streak has lasted ``patience`` observations and spans at least ``min_span`` steps.
    """

    def __init__(self, patience: int) -> None:
        self.patience = max(1, patience)
        self._count: dict[str, int] = {}
        self._start: dict[str, int] = {}
        self._fired: set[str] = set()

    def bump(self, key: str, cond: bool, step: int, min_span: int = 0) -> bool:
        if not cond:
            self._count.pop(key, None)
            self._start.pop(key, None)
            self._fired.discard(key)
            return False
        n = self._count[key] = self._count.get(key, 0) + 1
        start = self._start.setdefault(key, step)
        if key in self._fired or n < self.patience or step - start < min_span:
            return False
        self._fired.add(key)
        return True

    def mark(self, key: str, step: int) -> None:
        """Start ``key``'s streak at ``step`` as already reported (a condition that fires at once)."""
        self._count[key] = self._count.get(key, 0)
        self._start.setdefault(key, step)
        self._fired.add(key)

    def start(self, key: str) -> int:
        """The step at which the current streak of ``key`` began."""
        return self._start.get(key, -1)

    def count(self, key: str) -> int:
        return self._count.get(key, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"count": dict(self._count), "start": dict(self._start), "fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._count = {k: int(v) for k, v in state.get("count", {}).items()}
        self._start = {k: int(v) for k, v in state.get("start", {}).items()}
        self._fired = set(state.get("fired", []))

"""Straggler rule: one rank's step time far above the others' under ``torch.distributed``."""
from __future__ import annotations

import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule

#: per-rank mean step time since the last log, written by the cross-rank reduction (trackdiag.session.distributed)
PER_RANK = "diag/dist/per_rank/step_time_ms"


class Straggler(Rule):
    """Fires when the slowest rank's step time exceeds ``factor`` x the median of the other ranks'
    (and by at least ``min_ms``) at ``patience`` consecutive logging steps; ``where`` is ``rank N``. Reads the table
    ``diag/dist/per_rank/step_time_ms``: silent in single-process runs. Host only, no cost.

    Args:
        factor: how many times the others' median the slowest rank may take (> 1).
        min_ms: ignore gaps smaller than this (timer noise on tiny steps).
        patience: consecutive logging steps the same rank must be slow (one window is noisy).
    """

    kind = "straggler"
    hint = ("One rank is slower than the rest, and every rank waits for it at each collective: look for a "
            "slower device or host (thermal throttling, another job), an unbalanced data shard or longer "
            "sequences on that rank, or data loading on that rank (diag/dist/per_rank/*).")

    def __init__(self, *, factor: float = 1.5, min_ms: float = 1.0, patience: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not factor > 1.0:
            raise ConfigError([f"rules.straggler.factor: {factor!r} must be > 1"])
        self.factor = float(factor)
        self.min_ms = float(min_ms)
        self.patience = max(int(patience), 1)
        self._slow: tuple[str, int] = ("", 0)  # (rank, consecutive slow logging steps)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        per = record.tables.get(PER_RANK)
        if not per or len(per) < 2:
            return []
        slow = max(per, key=lambda r: (per[r], -int(r)))
        others = statistics.median(v for r, v in per.items() if r != slow)
        value = per[slow]
        if not (value > self.factor * others and value - others >= self.min_ms):
            self._slow = ("", 0)
            return []
        self._slow = (slow, self._slow[1] + 1 if self._slow[0] == slow else 1)
        if self._slow[1] >= self.patience:
            msg = f"rank {slow} takes {value:.1f} ms per step, {value / max(others, 1e-9):.1f}x the other ranks' median ({others:.1f} ms)."
            return [self.make(record.step, msg, value, self.factor * others, f"rank {slow}", ["persistent"])]
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"slow": list(self._slow)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rank, n = state.get("slow", ("", 0))
        self._slow = (str(rank), int(n))

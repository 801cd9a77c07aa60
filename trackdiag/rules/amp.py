"""AMP loss-scale rules: ``amp_scale_collapse`` and ``amp_overflow`` (from the ``scaler`` probe)."""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


class AmpScaleCollapse(Rule):
    """Fires when the ``GradScaler``'s loss scale falls below ``min_scale`` (1.0) or backs off
    ``max_backoff_streak`` (12) times in a row (65536 -> 16: every step overflows, even heavily
    down-scaled). Fires once per episode (again after the scale recovered); ``step`` is the first
    backoff of the streak."""

    kind = "amp_scale_collapse"
    hint = ("Gradients overflow at any scale: the model itself produces Inf/NaN. Run a step in fp32 to confirm, lower "
            "the LR, clip gradients after scaler.unscale_(optimizer), keep softmax/log/exp/normalisation in fp32 "
            "(autocast does most), prefer bf16 over fp16, look for a bad batch or a log(0)/division by zero.")

    def __init__(self, *, min_scale: float = 1.0, max_backoff_streak: int = 12, **kw: Any) -> None:
        super().__init__(**kw)
        self.min_scale, self.max_backoff_streak = min_scale, max_backoff_streak
        self._active = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        low = record.scalars.get("diag/amp/scale_min")
        streak = record.scalars.get("diag/amp/backoff_streak", 0.0)
        if low is None or not math.isfinite(low):
            return []
        hit = low < self.min_scale or streak >= self.max_backoff_streak
        fire, self._active = hit and not self._active, hit
        if not fire:
            return []
        events = record.tables.get("diag/amp/backoff_steps", {})
        step = int(events.get("streak_start", record.step))
        if low < self.min_scale:
            return [self.make(step, f"AMP loss scale collapsed to {low:.3g} (< {self.min_scale:g}) after {int(streak)} "
                                    f"back-to-back backoffs.", low, self.min_scale, evidence=["unambiguous"])]
        return [self.make(step, f"AMP loss scale backed off {int(streak)} times in a row from step {step} (now {low:.3g}): "
                                f"every step overflows.", streak, self.max_backoff_streak, evidence=["unambiguous"])]

    def state_dict(self) -> dict[str, Any]:
        return {"active": self._active}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._active = bool(state.get("active", False))


class AmpOverflow(Rule):
    """Fires when more than ``max_skip_fraction`` (0.25) of the last ``window`` (100) steps were skipped
    for Inf/NaN gradients (scale backoffs), judged once at least ``min_steps`` (50) steps are covered,
    so the scaler's calibration in the first steps (a few back-to-back backoffs) stays quiet."""

    kind = "amp_overflow"
    hint = ("Too many optimizer steps are skipped: lower the LR or add warm-up, clip gradients after "
            "scaler.unscale_(optimizer), lower init_scale or growth_factor / raise growth_interval, check for ops "
            "that overflow fp16 (use bf16, keep reductions in fp32).")

    def __init__(self, *, max_skip_fraction: float = 0.25, window: int = 100, min_steps: int = 50, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_skip_fraction, self.window, self.min_steps = max_skip_fraction, window, min_steps
        self._win: deque[tuple[int, float, float]] = deque()

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        n = record.scalars.get("diag/amp/window_steps")
        if not n:
            return []
        self._win.append((record.step, n, record.scalars.get("diag/amp/backoffs", 0.0)))
        while sum(s for _, s, _ in self._win) - self._win[0][1] >= self.window:
            self._win.popleft()
        steps = sum(s for _, s, _ in self._win)
        skips = sum(b for _, _, b in self._win)
        if steps < self.min_steps or skips / steps <= self.max_skip_fraction:
            return []
        frac = skips / steps
        return [self.make(record.step, f"{int(skips)} of the last {int(steps)} steps were skipped for Inf/NaN gradients "
                                       f"({frac:.0%} > {self.max_skip_fraction:.0%}).", frac, self.max_skip_fraction,
                          evidence=["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"window": [list(w) for w in self._win]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._win = deque(tuple(w) for w in state.get("window", []))  # type: ignore[misc]

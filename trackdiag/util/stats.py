"""Small host-side running statistics shared by probes and rules."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Ema:
    """Bias-corrected exponential moving average of the finite values it is fed."""

    beta: float = 0.9
    _avg: float = 0.0
    count: int = 0

    def update(self, value: float) -> float:
        if math.isfinite(value):
            self._avg = self.beta * self._avg + (1.0 - self.beta) * value
            self.count += 1
        return self.value

    @property
    def value(self) -> float:
        if self.count == 0:
            return math.nan
        return self._avg / (1.0 - self.beta**self.count)

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta, "avg": self._avg, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.beta, self._avg, self.count = state["beta"], state["avg"], int(state["count"])


#: how far a loss the loop computed may sit from the same loss recomputed in float64 and still be that loss: its own
#: rounding (a mean of n float32 terms is off by ~sqrt(n) ulps; 64 covers batches of thousands)
LOSS_ULPS = 64


def rounding_tolerance(loss: float, value: float, eps: float) -> float:
    """The distance within which ``loss`` (computed in a dtype of machine epsilon ``eps``) is ``value`` recomputed
    exactly: :data:`LOSS_ULPS` ulps of the larger (the loss-form probes' rules and ``loss_shape`` judge with it)."""
    return LOSS_ULPS * eps * max(abs(loss), abs(value)) + 1e-30


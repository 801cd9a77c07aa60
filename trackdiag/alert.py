"""The :class:`Alert` record a rule emits when a threshold trips."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SEVERITIES = ("info", "warning", "critical")
ACTIONS = ("log", "warn", "stop", "raise")


@dataclass(frozen=True)
class Alert:
    """One tripped rule.

    kind: stable identifier (``grad_explosion``, ``nonfinite_loss`` ...), part of the public API.
    step: the optimizer step at which the fault happened (not when it was noticed).
    severity: ``info`` | ``warning`` | ``critical``.
    message: what happened, in one sentence.
    value / threshold: the measured value and the limit it crossed (``nan`` when not numeric).
    where: the layer, component or series concerned (``""`` when global).
    hint: the usual remedies.
    """

    kind: str
    step: int
    severity: str
    message: str
    value: float = math.nan
    threshold: float = math.nan
    where: str = ""
    hint: str = ""

    def describe(self) -> str:
        place = f" in {self.where}" if self.where else ""
        return f"[{self.severity}] {self.kind} at step {self.step}{place}: {self.message} Hint: {self.hint}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("value", "threshold"):  # JSON has no NaN/Inf: keep them as strings
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Alert":
        return cls(**{**d, "value": float(d.get("value", "nan")), "threshold": float(d.get("threshold", "nan"))})

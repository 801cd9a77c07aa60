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
    evidence: what made the policy give it its severity (:mod:`trackdiag.core.policy`): ``persistent``,
        ``loss``, ``weights``, ``corroborated``, ``unambiguous``; empty for an info finding.
    count / last_step: how many times this incident was found (repeats and their consequences
        are folded into it, not raised again) and the step it was last seen at.
    """

    kind: str
    step: int
    severity: str
    message: str
    value: float = math.nan
    threshold: float = math.nan
    where: str = ""
    hint: str = ""
    evidence: tuple[str, ...] = ()
    count: int = 1
    last_step: int = -1

    def describe(self) -> str:
        from trackdiag.core.policy import describe

        place = f" in {self.where}" if self.where else ""
        why = f" ({describe(self.evidence)})" if self.evidence else ""
        return f"[{self.severity}] {self.kind} at step {self.step}{place}{why}: {self.message} Hint: {self.hint}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["evidence"] = list(self.evidence)
        for k in ("value", "threshold"):  # JSON has no NaN/Inf: keep them as strings
            if not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Alert":
        known = {f: d[f] for f in cls.__dataclass_fields__ if f in d}  # records of older versions lack some
        return cls(**{**known, "value": float(d.get("value", "nan")), "threshold": float(d.get("threshold", "nan")),
                      "evidence": tuple(d.get("evidence", ()))})

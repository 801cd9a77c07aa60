"""The alert book: one incident, one alert.

A rule may find the same thing again and again (a loss that stays NaN, a spike every few hundred
steps of one noisy layer). The book keeps one *incident* per ``(kind, place)``: its first finding is
emitted as an alert; later findings of it are folded in (``count`` and ``last_step`` grow, nothing
is emitted) until the rule has found nothing there for ``quiet`` steps (the rule's ``cooldown``).
An incident is raised again only when it changes: it worsens (a higher severity), or it ended and
comes back. ``alerts`` holds each incident's alert with its current count and last step.

Consequences: while a *critical* incident about the training dynamics is open (a blow-up, a
non-finite loss), findings of other dynamics kinds that follow it (divergence after an explosion,
dead units after a NaN) are folded into it as consequences, counted per kind, not raised as new
faults. Set-up and data findings (``INDEPENDENT``) are always judged on their own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trackdiag.core.alert import Alert
from trackdiag.core.policy import rank

R = TypeVar("R")

#: kinds about the set-up, the data, the machine: never a consequence of a training-dynamics incident
INDEPENDENT = frozenset({
    "label_range", "label_leak", "param_not_optimized", "grads_not_zeroed", "accumulation_reset", "memory_leak",
    "memory_pressure", "data_bottleneck", "straggler", "preflight", "initial_loss", "eval_mode", "grads_wiped",
    "nonfinite_input", "crash", "targets_from_outputs",
})


def merge_places(alerts: list[tuple[R, Alert]], limit: int) -> list[tuple[R, Alert]]:
    """One check of one rule tripping in more than ``limit`` places (a 500-layer model with 300 dead
    layers) becomes ONE alert: located at the earliest place, its message naming the others, so a
    broken model gives a readable alert instead of a flood."""
    by_rule: dict[int, list[tuple[R, Alert]]] = {}
    for rule, alert in alerts:
        by_rule.setdefault(id(rule), []).append((rule, alert))
    out: list[tuple[R, Alert]] = []
    for group in by_rule.values():
        if len(group) <= limit:
            out += group
            continue
        rule, first = min(group, key=lambda ra: (ra[1].step, -rank(ra[1].severity)))
        worst = max(group, key=lambda ra: rank(ra[1].severity))[1]
        places = [a.where for _, a in group if a.where]
        shown = ", ".join(places[:8]) + (f" (+{len(places) - 8} more)" if len(places) > 8 else "")
        msg = f"{first.message} Same in {len(group)} places: {shown}."
        out.append((rule, dataclasses.replace(first, message=msg, severity=worst.severity, evidence=worst.evidence)))
    return out


@dataclass
class Incident:
    """One ongoing problem: its alert (as emitted), how often it was found, what it absorbed."""

    alert: Alert
    index: int  # position of its alert in ``AlertBook.alerts``
    quiet: int
    count: int = 1
    last_step: int = 0
    folded: dict[str, int] = field(default_factory=dict)  # consequences, per kind

    def open_at(self, step: int) -> bool:
        return step - self.last_step <= self.quiet


class AlertBook:
    """Admits findings as incidents (see module docstring) and keeps counts per kind."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.kinds: dict[str, dict[str, Any]] = {}
        self.consequences: dict[str, int] = {}  # findings folded into another incident, per kind
        self.incidents: list[Incident] = []
        self._open: dict[tuple[str, str], Incident] = {}

    def admit(self, alert: Alert, cooldown: int, key: str | None = None) -> bool:
        """True when ``alert`` is emitted (a new incident, or one that worsened); False when it is
        folded into the open incident at the same ``key`` (default: its ``where``), found again within
        ``cooldown`` steps of its last finding."""
        entry = self.kinds.setdefault(alert.kind, {"count": 0, "first_step": alert.step, "first_where": alert.where,
                                                   "suppressed": 0, "severity": alert.severity, "findings": 0,
                                                   "last_step": alert.step})
        entry["findings"] += 1
        entry["last_step"] = max(entry["last_step"], alert.step)
        ident = (alert.kind, alert.where if key is None else key)
        inc = self._open.get(ident)
        if inc is not None and inc.open_at(alert.step) and rank(alert.severity) <= rank(inc.alert.severity):
            self._fold(inc, alert.step)
            entry["suppressed"] += 1
            return False
        inc = Incident(alert, len(self.alerts), max(cooldown, 0), last_step=max(alert.step, alert.last_step))
        self._open[ident] = inc
        self.incidents.append(inc)
        self.alerts.append(alert)
        entry["count"] += 1
        if rank(alert.severity) > rank(entry["severity"]):
            entry["severity"] = alert.severity
        if alert.step < entry["first_step"]:
            entry["first_step"], entry["first_where"] = alert.step, alert.where
        return True

    def _fold(self, inc: Incident, step: int) -> None:
        inc.count += 1
        inc.last_step = max(inc.last_step, step)
        self.alerts[inc.index] = dataclasses.replace(inc.alert, count=inc.count, last_step=inc.last_step)

    def absorbing(self, alert: Alert) -> Incident | None:
        """The open critical dynamics incident ``alert`` is a consequence of, if any: it began at or
        before ``alert``'s step, is about another kind, and ``alert`` is not independent of it."""
        if alert.kind in INDEPENDENT or alert.kind.startswith("nonfinite_"):
            return None  # NaN/Inf is always told (the replay names its module); its own incident folds repeats
        for inc in reversed(self.incidents):
            a = inc.alert
            if (a.severity == "critical" and a.kind not in INDEPENDENT and a.kind != alert.kind
                    and a.step <= alert.step and inc.open_at(alert.step)):
                return inc
        return None

    def suppress(self, alert: Alert, into: Incident | None = None) -> None:
        """Count ``alert`` as a consequence of an earlier fault: not emitted, not a kind of its own.
        Folding it into ``into`` keeps that incident open while its consequences go on."""
        self.consequences[alert.kind] = self.consequences.get(alert.kind, 0) + 1
        if into is not None:
            into.folded[alert.kind] = into.folded.get(alert.kind, 0) + 1
            self._fold(into, alert.step)
            into.count -= 1  # a consequence is not another finding of the incident itself
            self.alerts[into.index] = dataclasses.replace(self.alerts[into.index], count=into.count)

    def health(self) -> str:
        """``critical`` if any critical alert was emitted, ``warning`` if any other, else ``ok``."""
        severities = {a.severity for a in self.alerts}
        if "critical" in severities:
            return "critical"
        return "warning" if severities - {"info"} else "ok"

    def summary(self) -> list[dict[str, Any]]:
        """Every incident: its alert as a dict plus ``consequences`` (kind -> findings folded in)."""
        return [{**self.alerts[i.index].to_dict(), "consequences": dict(i.folded)} for i in self.incidents]

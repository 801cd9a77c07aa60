"""The alert book: cooldown, counts per kind, and the run's health."""
from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from trackdiag.alert import Alert

R = TypeVar("R")


def merge_places(alerts: list[tuple[R, Alert]], limit: int) -> list[tuple[R, Alert]]:
    """One check of one rule tripping in more than ``limit`` places (a 500-layer model with 300 dead
    layers) becomes ONE alert: located at the earliest place, its message naming the others, so a
    broken model gives a readable alert instead of a flood and cooldown stays meaningful."""
    by_rule: dict[int, list[tuple[R, Alert]]] = {}
    for rule, alert in alerts:
        by_rule.setdefault(id(rule), []).append((rule, alert))
    out: list[tuple[R, Alert]] = []
    for group in by_rule.values():
        if len(group) <= limit:
            out += group
            continue
        rule, first = min(group, key=lambda ra: ra[1].step)
        places = [a.where for _, a in group if a.where]
        shown = ", ".join(places[:8]) + (f" (+{len(places) - 8} more)" if len(places) > 8 else "")
        msg = f"{first.message} Same in {len(group)} places: {shown}."
        out.append((rule, dataclasses.replace(first, message=msg)))
    return out


class AlertBook:
    """Admits alerts subject to a per-(kind, where) cooldown and keeps counts per kind."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.kinds: dict[str, dict[str, Any]] = {}
        self.consequences: dict[str, int] = {}  # alerts held back during a non-finite incident, per kind
        self._last: dict[tuple[str, str], int] = {}

    def admit(self, alert: Alert, cooldown: int) -> bool:
        """True if ``alert`` is emitted; False if a same-place repeat within ``cooldown`` steps."""
        entry = self.kinds.setdefault(alert.kind, {"count": 0, "first_step": alert.step, "first_where": alert.where,
                                                   "suppressed": 0, "severity": alert.severity})
        key = (alert.kind, alert.where)
        last = self._last.get(key)
        if last is not None and 0 <= alert.step - last < cooldown:
            entry["suppressed"] += 1
            return False
        self._last[key] = alert.step
        self.alerts.append(alert)
        entry["count"] += 1
        if alert.step < entry["first_step"]:
            entry["first_step"], entry["first_where"] = alert.step, alert.where
        return True

    def suppress(self, alert: Alert) -> None:
        """Count ``alert`` as a consequence of an earlier fault: not emitted, not a kind of its own."""
        self.consequences[alert.kind] = self.consequences.get(alert.kind, 0) + 1

    def health(self) -> str:
        """``critical`` if any critical alert was emitted, ``warning`` if any other, else ``ok``."""
        severities = {a.severity for a in self.alerts}
        if "critical" in severities:
            return "critical"
        return "warning" if severities - {"info"} else "ok"

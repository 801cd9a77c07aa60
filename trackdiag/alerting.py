"""The alert book: cooldown, counts per kind, and the run's health."""
from __future__ import annotations

from typing import Any

from trackdiag.alert import Alert


class AlertBook:
    """Admits alerts subject to a per-(kind, where) cooldown and keeps counts per kind."""

    def __init__(self) -> None:
        self.alerts: list[Alert] = []
        self.kinds: dict[str, dict[str, Any]] = {}
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

    def health(self) -> str:
        """``critical`` if any critical alert was emitted, ``warning`` if any other, else ``ok``."""
        severities = {a.severity for a in self.alerts}
        if "critical" in severities:
            return "critical"
        return "warning" if severities - {"info"} else "ok"

"""The MLflow sink's alert bookkeeping: ``diag/alerts/<kind>`` on the loss's step axis, and what the
run's description (:mod:`~trackdiag.sinks.mlflow.note`) says about each kind.

A running count logged only at each alert's step draws a chart that starts at the kind's first
alert (x 101-115 in a 300-step run) and cannot be read against the loss. :class:`AlertSeries`
gives every kind's series the run's step range and a step shape: 0 at the run's first step, the
previous count one step before each alert, the new count at the alert's step, and the final count
at the run's last step (added at close). MLflow draws straight lines between points, so without
the point one step before, a count would seem to ramp up over the steps before an alert.

Costs: O(1) per record (its first and last step) and a few points per alert.
"""
from __future__ import annotations

import time
from typing import Any

from trackdiag.core.alert import Alert
from trackdiag.core.record import Record

Row = list[Any]  # [step, timestamp ms, {key: value}, {}]: the sink's pending-points format


class AlertSeries:
    """Alert counts per kind as step-shaped series over the run's steps (see the module doc)."""

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.alerts: list[dict[str, Any]] = []   # every alert, as ``Alert.to_dict()``
        self.counts: dict[str, int] = {}
        self.first: dict[str, int] = {}          # kind -> first step
        self._last: dict[str, int] = {}          # kind -> step of its latest point

    def saw(self, record: Record) -> None:
        """Widen the run's step range by ``record`` (its step and its series' first and last points)."""
        lo = hi = int(record.step)
        for pts in record.series.values():
            if pts:
                lo = min(lo, int(pts[0][0]), int(pts[-1][0]))
                hi = max(hi, int(pts[0][0]), int(pts[-1][0]))
        self.first_step = lo if self.first_step is None else min(self.first_step, lo)
        self.last_step = hi if self.last_step is None else max(self.last_step, hi)

    def add(self, alert: Alert) -> tuple[list[Row], bool]:
        """Count ``alert``; returns (the points to log, whether its kind's first step changed)."""
        kind, step = alert.kind, int(alert.step)
        key = f"diag/alerts/{kind}"
        ts = int(time.time() * 1000)
        self.alerts.append(alert.to_dict())
        before = self.counts.get(kind, 0)
        self.counts[kind] = before + 1
        rows: list[Row] = []
        last = self._last.get(kind)
        if last is None and self.first_step is not None and step > self.first_step:
            rows.append([self.first_step, ts, {key: 0.0}, {}])  # the series starts where the loss does
            last = self.first_step
        if last is not None and step - 1 > last:
            rows.append([step - 1, ts, {key: float(before)}, {}])  # flat until the alert's step
        rows.append([step, ts, {key: float(before + 1)}, {}])
        self._last[kind] = max(step, last if last is not None else step)
        new_first = kind not in self.first or step < self.first[kind]
        if new_first:
            self.first[kind] = step
        return rows, new_first

    def closing_points(self) -> list[Row]:
        """The final count of every kind at the run's last step (where the loss ends)."""
        if self.last_step is None:
            return []
        ts = int(time.time() * 1000)
        return [[self.last_step, ts, {f"diag/alerts/{kind}": float(n)}, {}]
                for kind, n in self.counts.items() if self.last_step > self._last.get(kind, self.last_step)]

    def worst(self) -> str:
        """Health so far from the alerts' severities: critical | warning | ok (info alerts: ok)."""
        severities = {a.get("severity") for a in self.alerts}
        return "critical" if "critical" in severities else "warning" if "warning" in severities else "ok"

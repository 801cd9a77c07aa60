"""Console sink: one line when the run opens, and a table of alerts and health when it closes.
Uses ``rich`` when installed, plain text otherwise. Writes to stderr so stdout stays the user's."""
from __future__ import annotations

import sys
from typing import Any, TextIO

from trackdiag.runinfo import RunInfo
from trackdiag.sinks.base import Sink

NOTE_ABOVE = 0.05  # overhead fraction above which the summary says how to cut it


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run report as plain text."""
    overhead = summary.get("overhead", {})
    fraction, per_step = overhead.get("fraction", 0.0), overhead.get("per_step_ms", 0.0)
    lines = [f"trackdiag: {summary.get('steps', 0)} steps, health {summary.get('health', '?').upper()}, "
             f"overhead {100 * fraction:.2f}% ({per_step:.2f} ms/step)"]
    if fraction > NOTE_ABOVE:
        lines.append("  (mostly fixed costs, per step, per logging step and at start-up: with steps this short, "
                     "log less often with a larger `every` (diag.every=50) or use a lighter preset)")
    alerts = summary.get("alerts", {})
    if alerts:
        lines.append(f"  {'alert':<22}{'count':>7}{'first step':>12}{'suppressed':>12}  where (first)")
        for kind, a in alerts.items():
            lines.append(f"  {kind:<22}{a['count']:>7}{a['first_step']:>12}{a['suppressed']:>12}  {a.get('first_where', '')}")
    else:
        lines.append("  no alerts")
    if summary.get("output_dir"):
        lines.append(f"  records: {summary['output_dir']}")
    return "\n".join(lines)


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream

    def open(self, run: RunInfo) -> None:
        print(f"trackdiag: level={run.level} run={run.name} records -> {run.output_dir}", file=self.stream or sys.stderr)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        stream = self.stream or sys.stderr
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            print(format_summary(summary), file=stream)
            return
        table = Table(title=f"trackdiag — {summary.get('steps', 0)} steps, health {summary.get('health', '?')}")
        for col in ("alert", "count", "first step", "suppressed", "where (first)"):
            table.add_column(col)
        for kind, a in summary.get("alerts", {}).items():
            table.add_row(kind, str(a["count"]), str(a["first_step"]), str(a["suppressed"]), a.get("first_where", ""))
        console = Console(file=stream)
        console.print(table if summary.get("alerts") else format_summary(summary))
        if summary.get("alerts"):
            console.print(f"records: {summary.get('output_dir')}")

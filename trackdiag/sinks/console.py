"""Console sink: one line when the run opens, and a table of alerts and health when it closes.
Uses ``rich`` when installed, plain text otherwise. Writes to stderr so stdout stays the user's.

Also :class:`DeliveryProgress`, the feedback trackers give while they finish at close.
"""
from __future__ import annotations

import contextlib
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, TextIO

from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.base import Sink

NOTE_ABOVE = 0.05  # overhead fraction above which the summary says how to cut it


def display_health(summary: dict[str, Any]) -> str:
    """Health as shown to people: ``failed``/``killed`` when the run did not end normally and its
    alerts said nothing worse (a crash with no alerts is not "ok"; the flight recorder's ``crash``
    finding, which describes that very failure, does not count), else ok|warning|critical."""
    health = str(summary.get("health", "unknown"))
    status = str(summary.get("status") or "FINISHED")
    alerts = summary.get("alerts") or {}
    if status != "FINISHED" and "crash" in alerts and isinstance(alerts, dict):
        # the crash finding describes the failure the status already names: health is what the rest said
        rest = {str(v.get("severity", "warning")) for k, v in alerts.items() if k != "crash" and isinstance(v, dict)}
        health = "critical" if "critical" in rest else "warning" if rest - {"info"} else "ok"
    if status != "FINISHED" and health in ("ok", "unknown"):
        return status.lower() if status in ("FAILED", "KILLED") else "failed"
    return health


def headline(summary: dict[str, Any]) -> str:
    """``150 steps, run FAILED, health FAILED`` (the status only when the run did not finish)."""
    status = str(summary.get("status") or "FINISHED")
    run = f", run {status}" if status != "FINISHED" else ""
    return f"{summary.get('steps', 0)} steps{run}, health {display_health(summary).upper()}"


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run report as plain text."""
    overhead = summary.get("overhead", {})
    fraction, per_step = overhead.get("fraction", 0.0), overhead.get("per_step_ms", 0.0)
    lines = [f"trackdiag: {headline(summary)}, overhead {100 * fraction:.2f}% ({per_step:.2f} ms/step)"]
    lines += budget_lines(summary)
    if fraction > NOTE_ABOVE and not (summary.get("budget") or {}).get("shed"):
        lines.append("  (mostly fixed costs, per step, per logging step and at start-up: with steps this short, "
                     "log less often with a larger `every` (diag.every=50) or use a lighter preset)")
    alerts = summary.get("alerts", {})
    if alerts:
        lines.append(f"  {'alert':<22}{'count':>7}{'first step':>12}{'suppressed':>12}  where (first)")
        for kind, a in alerts.items():
            lines.append(f"  {kind:<22}{a['count']:>7}{a['first_step']:>12}{a['suppressed']:>12}  {a.get('first_where', '')}")
    else:
        lines.append("  no alerts")
    lines += where_lines(summary)
    return "\n".join(lines)


def budget_lines(summary: dict[str, Any]) -> list[str]:
    """What the cost budget shed (:mod:`trackdiag.session.budget_policy`), and whether the run is still above it."""
    budget = summary.get("budget") or {}
    lines = [f"  within the {100 * budget['share']:.0f}% cost budget from step {shed['step']}: {shed.get('what', shed['shed'])}"
             for shed in budget.get("shed", ())]
    if budget.get("over"):
        lines.append("  still above the cost budget with all it may shed shed: use a lighter preset or a larger `every` "
                     "(diag.every=50)")
    elif lines and budget.get("measured") is not None:
        lines.append(f"  since then ~{100 * budget['measured']:.1f}% of each step (the budget's estimate of the wall cost; "
                     f"the overhead above averages the whole run, its start at the preset's cadence included)")
    return lines


def where_lines(summary: dict[str, Any]) -> list[str]:
    """Where the run's results are and the one command that shows them again, with this
    interpreter's path (so it works pasted into a shell where the venv is not active)."""
    out = summary.get("output_dir")
    if not out:
        return []
    report = " (open report.html there in a browser)" if (Path(out) / "report.html").is_file() else ""
    return [f"  results: {out}{report}",
            f"  to look again: {shlex.quote(sys.executable)} -m trackdiag summary {shlex.quote(str(out))}"]


class ConsoleSink(Sink):
    name = "console"

    def __init__(self, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.stream = stream
        self.enabled = enabled  # the session leaves the console out when False (diag.sink.console.enabled=false)

    def open(self, run: RunInfo) -> None:
        print(f"trackdiag: level={run.level} run={run.name} records -> {run.output_dir}", file=self.stream or sys.stderr)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        """Print the summary table: status (when not FINISHED), health, alerts, where the results are
        and the command that shows them again."""
        stream = self.stream or sys.stderr
        summary = {**summary, "status": status}
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            print(format_summary(summary), file=stream)
            return
        table = Table(title=f"trackdiag — {headline(summary)}")
        for col in ("alert", "count", "first step", "suppressed", "where (first)"):
            table.add_column(col)
        for kind, a in summary.get("alerts", {}).items():
            table.add_row(kind, str(a["count"]), str(a["first_step"]), str(a["suppressed"]), a.get("first_where", ""))
        console = Console(file=stream, soft_wrap=True)  # paths and commands stay whole, pasteable
        console.print(table if summary.get("alerts") else format_summary(summary), highlight=False, markup=False)
        if summary.get("alerts"):
            console.print("\n".join(budget_lines(summary) + where_lines(summary)), highlight=False, markup=False)


def say(line: str, stream: TextIO | None = None) -> None:
    """One console line from a sink (stderr, flushed: stdout stays the user's)."""
    print(line, file=stream or sys.stderr, flush=True)


class DeliveryProgress:
    """What a tracker prints while it finishes at close (called with ``(done, total)`` pairs of
    (points, files), ~4 times a second): nothing if it is done within ``after`` s; then one line
    saying what is left (``trackdiag: delivering 812 points and 14 files to MLflow at ... ``); on a
    terminal, after ``bar_after`` s, a progress bar redrawn in place; at the end a line with the
    time taken (when a line was printed). Totals of (0, 0) show elapsed time only (W&B)."""

    def __init__(self, what: str, stream: TextIO | None = None, after: float = 0.5, bar_after: float = 2.0) -> None:
        self.what, self.stream, self.after, self.bar_after = what, stream, after, bar_after
        self.t0 = time.monotonic()
        self.announced = self._bar = False
        self._last_draw = 0.0

    def _out(self) -> TextIO:
        return self.stream or sys.stderr

    def __call__(self, done: tuple[int, int], total: tuple[int, int]) -> None:
        now = time.monotonic()
        elapsed = now - self.t0
        if elapsed < self.after:
            return
        left = (max(total[0] - done[0], 0), max(total[1] - done[1], 0))
        out = self._out()
        if not self.announced:
            self.announced = True
            what = " and ".join(x for x in (f"{left[0]} points" if left[0] else "",
                                            f"{left[1]} files" if left[1] else "") if x) or "the run's last data"
            print(f"trackdiag: delivering {what} to {self.what} ...", file=out, flush=True)
        if elapsed >= self.bar_after and getattr(out, "isatty", lambda: False)() and now - self._last_draw >= 0.25:
            self._last_draw, self._bar = now, True
            n, d = sum(total), sum(done)
            bar = ("#" * int(30 * d / n)).ljust(30, ".") if n else ""
            count = f" {d}/{n}" if n else ""
            out.write(f"\r  [{bar}]{count} {elapsed:.0f}s ")
            out.flush()

    def finish(self, note: str | None = None) -> None:
        """End the feedback: newline after a bar, and the time taken if a line was printed."""
        if not self.announced:
            return
        out = self._out()
        if self._bar:
            out.write("\n")
        print(f"trackdiag: {note or 'done'} ({time.monotonic() - self.t0:.1f}s)", file=out, flush=True)

    @contextlib.contextmanager
    def ticking(self) -> Iterator[None]:
        """Call this reporter (elapsed time only) while the body blocks, e.g. ``wandb.finish()``."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(0.25):
                self((0, 0), (0, 0))

        t = threading.Thread(target=tick, name="trackdiag-progress", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join(1.0)

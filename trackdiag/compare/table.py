"""The comparison table: runs x swept hyperparameters x health x alerts x first anomaly x losses.

Rows are plain dicts, so the same table renders as a rich terminal table, CSV or JSON.
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import TYPE_CHECKING, Any

from trackdiag.compare.runs import MISSING, NO_TRACKDIAG, RunSummary, finite_or_none, format_value
from trackdiag.compare.safe_read import clip
from trackdiag.compare import trials as trial_cols

if TYPE_CHECKING:
    from trackdiag.compare.comparison import Comparison

MAX_CELL = 60  # display width of a hyperparameter cell (long values end in a hash, so they stay distinct)
HEALTH_STYLE = {"critical": "bold red", "warning": "yellow", "failed": "magenta", "unknown": "dim", "ok": "green",
                NO_TRACKDIAG: "dim"}


def rows(runs: list[RunSummary], swept: list[str], kinds: list[str]) -> list[dict[str, Any]]:
    """One flat dict per run (already sorted): the CSV columns, in order (the trial columns when any
    run is an Optuna trial)."""
    out = []
    with_trials = any(r.trial for r in runs)
    for r in runs:
        row: dict[str, Any] = {"run": r.label, "status": r.status, "health": r.display_health}
        row.update(trial_cols.row(r.trial) if with_trials else {})
        row.update({p: r.hparams.get(p) for p in swept})
        for k in kinds:
            row[f"{k}.count"] = r.alert_counts.get(k, 0)
            row[f"{k}.first_step"] = r.first_steps.get(k)
        row.update({
            "first_anomaly": r.first_anomaly, "steps": r.steps, "final_loss": _num(r.final_loss),
            "best_loss": _num(r.best_loss), "best_eval_loss": _num(r.best_eval_loss), "name": r.name,
            "source": r.source_id, "note": r.note,
        })
        out.append(row)
    return out


def to_csv(comparison: "Comparison") -> str:
    """The table as CSV text (empty cells for missing values)."""
    table = rows(comparison.runs, comparison.swept, comparison.kinds)
    buf = io.StringIO()
    if table:
        writer = csv.DictWriter(buf, fieldnames=list(table[0]), lineterminator="\n")
        writer.writeheader()
        for row in table:
            writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buf.getvalue()


def to_json(comparison: "Comparison") -> str:
    """Everything: source, headline, swept params, kinds, per-run details and the risk summary."""
    return json.dumps(comparison.to_dict(), indent=2, default=str, allow_nan=False)


def cells(r: RunSummary, swept: list[str], kinds: list[str], trials: bool = False) -> list[str]:
    """Display cells for one run: alert kinds read ``count @first_step``; blanks for none; with
    ``trials``, the Optuna trial's columns (:data:`trackdiag.compare.trials.COLUMNS`) after health."""
    out = [r.label, r.status, r.display_health, *(trial_cols.cells(r.trial) if trials else [])]
    out += [clip(format_value(r.hparams.get(p, MISSING)), MAX_CELL) for p in swept]
    for k in kinds:
        n = r.alert_counts.get(k, 0)
        out.append(f"{n} @{r.first_steps[k]}" if n and k in r.first_steps else (str(n) if n else ""))
    out += ["" if r.first_anomaly is None else str(r.first_anomaly), _fmt_loss(r.final_loss),
            _fmt_loss(r.best_loss), _fmt_loss(r.best_eval_loss)]
    return out


def headers(swept: list[str], kinds: list[str], trials: bool = False) -> list[str]:
    """Column titles matching :func:`cells`."""
    return ["run", "status", "health", *(trial_cols.COLUMNS if trials else ()), *swept, *kinds, "first anomaly", "final loss", "best loss", "best eval"]


def rich_renderables(comparison: "Comparison") -> list[Any]:
    """The table and the risk summary as rich renderables (needs ``rich``; the CLI prints them)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"trackdiag compare — {comparison.headline}", caption=comparison.source)
    for h in headers(comparison.swept, comparison.kinds, comparison.has_trials):
        table.add_column(h, justify="left" if h in ("run", "status", "health") else "right", no_wrap=True)
    for r in comparison.runs:
        row: list[Any] = list(cells(r, comparison.swept, comparison.kinds, comparison.has_trials))
        row[2] = Text(row[2], style=HEALTH_STYLE.get(r.display_health, ""))
        table.add_row(*row)
    out: list[Any] = [table]
    if comparison.has_trials:
        out.append(Text(comparison.stop_line, style="bold"))
    if comparison.risk_lines:
        out.append(Text("Anomaly rate per swept value", style="bold"))
        out += [Text(f"  {line}") for line in comparison.risk_lines]
    return out


def render_text(comparison: "Comparison") -> str:
    """A plain fixed-width table plus the risk summary."""
    head = headers(comparison.swept, comparison.kinds, comparison.has_trials)
    body = [cells(r, comparison.swept, comparison.kinds, comparison.has_trials) for r in comparison.runs]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [f"trackdiag compare — {comparison.headline}", "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in body]
    if comparison.has_trials:
        lines += ["", comparison.stop_line]
    if comparison.risk_lines:
        lines += ["", "Anomaly rate per swept value:"] + [f"  {x}" for x in comparison.risk_lines]
    return "\n".join(lines)


def _num(v: float | None) -> float | str | None:
    """Finite numbers as-is, non-finite as 'nan'/'inf' text, None as None (CSV/JSON-safe)."""
    if v is None:
        return None
    return v if finite_or_none(v) is not None else str(v)


def _fmt_loss(v: float | None) -> str:
    """Loss for display: 4 significant digits, 'nan'/'inf' kept."""
    if v is None:
        return ""
    return f"{v:.4g}" if math.isfinite(v) else str(v)

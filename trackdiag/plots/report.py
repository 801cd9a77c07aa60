"""The run report: one self-contained HTML page (images embedded as base64, no scripts, no external
resources), so it opens anywhere, in MLflow's artifact viewer included.

``build_report(run_dir)`` reads the local record of a run and writes into ``<run_dir>/plots/``:
``loss_alerts.png`` (loss curves with the alert timeline), ``grad_flow.png``, ``grad_hist.png``,
``param_hist.png``, ``memory.png`` (each only when its data was logged), and ``<run_dir>/report.html``
with those images, the newest ``landscape/*.png``, the alert table, the model summary and the
environment report (``model_summary.json`` / ``environment.json`` in the run dir, when present).
The page opens with the run's health and status: the report is drawn while the run closes, so the
local sink stamps the final values in (:func:`stamp_status`) once it knows them.
Cost: reading the records plus ~0.2-0.5 s per figure.
"""
from __future__ import annotations

import base64
import html
import json
import logging
import math
import re
from pathlib import Path
from typing import Any, Iterable

from trackdiag.core.alert import Alert
from trackdiag.core.errors import brief
from trackdiag.core.record import Record
from trackdiag.plots import describe, figure, loss_points, save

log = logging.getLogger("trackdiag")
_SEVERITY = {"info": "#3182bd", "warning": "#ff7f00", "critical": "#cb181d"}
_CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}.critical{color:#cb181d}.warning{color:#b35900}
.muted{color:#777;font-size:12px}.status{font-size:15px;margin:4px 0 12px}.ok{color:#2c7a2c}"""
_STATUS = re.compile(r'<p class="status" id="trackdiag-status">.*?</p>', re.S)


def status_line(health: str, status: str) -> str:
    """The report's first line: ``health CRITICAL · run FINISHED`` (coloured by health)."""
    css = {"critical": "critical", "warning": "warning", "ok": "ok"}.get(health, "critical")
    return (f'<p class="status" id="trackdiag-status">health <b class="{css}">{html.escape(health.upper())}</b>'
            f' · run <b>{html.escape(status)}</b></p>')


def stamp_status(run_dir: str | Path, health: str, status: str) -> bool:
    """Write the final health and status into ``<run_dir>/report.html`` (atomically: a reader sees
    the old page or the new one). Returns False when there is no report to stamp."""
    page = Path(run_dir) / "report.html"
    try:
        text = page.read_text(encoding="utf-8")
    except OSError:
        return False
    new, n = _STATUS.subn(lambda _: status_line(health, status), text, count=1)
    if not n:
        return False
    tmp = page.with_name(".report.html.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(page)
    return True


def _spans(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive steps as (first, last) pairs (gaps of more than one step split them)."""
    out: list[tuple[int, int]] = []
    for s in sorted(steps):
        if out and s <= out[-1][1] + 1:
            out[-1] = (out[-1][0], s)
        else:
            out.append((s, s))
    return out


def plot_loss_alerts(records: Iterable[Record], path: str | Path) -> Path | None:
    """Loss curves over steps with every alert marked (vertical line and a timeline row per kind), over
    the whole run (x axis from the first to the last recorded step); steps whose loss was NaN/Inf are
    shaded red (their points cannot be drawn)."""
    records = list(records)
    curves = loss_points(records)
    alerts = [a for r in records for a in r.alerts]
    if not curves and not alerts:
        return None
    fig = figure(9.0, 5.0)
    top, strip = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    finite: list[float] = []
    bad: set[int] = set()
    for key, pts in curves.items():
        steps = [s for s, v in pts]
        vals = [v if math.isfinite(v) else math.nan for _, v in pts]
        finite += [v for v in vals if v == v]
        bad.update(s for s, v in pts if not math.isfinite(v))
        top.plot(steps, vals, lw=1.2, marker="." if len(pts) < 50 else None, label=key)
    for i, (a, b) in enumerate(_spans(sorted(bad))):
        top.axvspan(a - 0.5, b + 0.5, color="#cb181d", alpha=0.12, lw=0,
                    label=f"loss NaN/Inf ({len(bad)} steps)" if i == 0 else None)
    if finite and min(finite) > 0 and max(finite) > 10 * min(finite):  # log scale when it spans a decade
        top.set_yscale("log")
    kinds = list(dict.fromkeys(a.kind for a in alerts))
    for a in alerts[:500]:
        colour = _SEVERITY.get(a.severity, "#777")
        top.axvline(a.step, color=colour, alpha=0.5, lw=1)
        strip.scatter([a.step], [kinds.index(a.kind)], color=colour, marker="v", s=30, zorder=3)
    steps_seen = [r.step for r in records] + [s for pts in curves.values() for s, _ in pts] + [a.step for a in alerts]
    first, last = min(steps_seen), max(steps_seen)
    pad = max(1.0, 0.01 * (last - first))
    strip.set_xlim(first - pad, last + pad)  # the whole run, also when the loss stops being finite early
    strip.set_yticks(range(len(kinds)), kinds, fontsize=7)
    strip.set_ylim(-0.7, max(len(kinds), 1) - 0.3)
    strip.set_xlabel("step", fontsize=8)
    strip.set_title("alerts" if alerts else "alerts: none", fontsize=9)
    top.set_title(f"loss and alerts (steps {first}-{last})", fontsize=11)
    if curves or bad:
        top.legend(fontsize=7)
    top.grid(alpha=0.3)
    return save(fig, path)


def _number(v: float) -> str:
    """A threshold for the alert table: NaN (no numeric limit, e.g. a non-finite loss) reads ``none``."""
    return "none" if isinstance(v, float) and math.isnan(v) else describe(v)


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'


def _table(rows: list[dict[str, Any]] | dict[str, Any], header: tuple[str, ...] = ("key", "value")) -> str:
    if isinstance(rows, dict):
        rows = [dict(zip(header, (k, v))) for k, v in rows.items()]
    if not rows:
        return '<p class="muted">none</p>'
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(describe(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def render_html(path: str | Path, *, title: str, meta: dict[str, Any], images: list[tuple[str, Path]],
                alerts: list[Alert], summaries: dict[str, dict[str, Any]] | None = None,
                environment: dict[str, Any] | None = None, health: str = "ok", status: str = "RUNNING") -> Path:
    """Write the report page to ``path``: health and status, metadata, images, alert table,
    summary and environment."""
    from trackdiag.plots.environment import flatten

    parts = [f"<h1>{html.escape(title)}</h1>", status_line(health, status), _table(meta)]
    for caption, img in images:
        parts += [f"<h2>{html.escape(caption)}</h2>", _img(img)]
    parts.append(f"<h2>alerts ({len(alerts)})</h2>")
    parts.append(_table([{"step": a.step, "severity": a.severity, "kind": a.kind, "where": a.where,
                          "value": a.value, "threshold": _number(a.threshold), "message": a.message,
                          "hint": a.hint} for a in alerts[:1000]]))
    for name, summary in (summaries or {}).items():
        totals = {k: v for k, v in summary.items() if k != "modules"}
        parts += [f"<h2>model summary{' — ' + html.escape(name) if name else ''}</h2>", _table(totals),
                  _table(summary.get("modules", []))]
    if environment:
        parts += ["<h2>environment</h2>", _table(flatten(environment))]
    page = ("<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(parts) + "</body></html>")
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def layer_labels(summaries: dict[str, Any]) -> dict[str, str]:
    """Tick labels from the model summaries: a layer named by a bare index (``0``, ``blocks.3``) reads
    ``0 (Linear)``; keys are ``<layer>`` (``<component>/<layer>`` for named components)."""
    out: dict[str, str] = {}
    for comp, summary in summaries.items():
        rows = summary.get("modules", []) if isinstance(summary, dict) else []
        for row in rows if isinstance(rows, list) else []:
            name, kind = (row.get("name"), row.get("type")) if isinstance(row, dict) else (None, None)
            if isinstance(name, str) and isinstance(kind, str) and name.rpartition(".")[2].isdigit():
                out[f"{comp}/{name}" if comp else name] = f"{name} ({kind})"
    return out


def build_report(run_dir: str | Path, records: list[Record] | None = None, *, write_html: bool = True) -> list[Path]:
    """Render every picture the run's records allow and (with ``write_html``) the HTML page; returns the
    files written. Without matplotlib: one warning, and a page with the tables only."""
    from trackdiag.core.record import read_records
    from trackdiag.plots.gradflow import plot_grad_flow
    from trackdiag.plots.histograms import plot_histograms
    from trackdiag.plots.memory import plot_memory

    run_dir = Path(run_dir)
    if records is None:
        records = list(read_records(run_dir))
    out = run_dir / "plots"
    drawn: list[tuple[str, Path | None]] = []
    try:
        import matplotlib  # noqa: F401
        pictures = True
    except ImportError:
        log.warning("trackdiag: no pictures in the report: matplotlib is missing (pip install 'trackdiag[plots]')")
        pictures = False
    summaries = _json(run_dir / "model_summary.json") or {}
    if "modules" in summaries:  # a single model; several components are keyed by name
        summaries = {"": summaries}
    labels = layer_labels(summaries)
    for caption, draw in () if not pictures else (
        ("loss and alerts", lambda: plot_loss_alerts(records, out / "loss_alerts.png")),
        ("gradient flow", lambda: plot_grad_flow(records, out / "grad_flow.png", labels=labels)),
        ("gradient histograms", lambda: plot_histograms(records, "grad", out / "grad_hist.png", labels=labels)),
        ("parameter histograms", lambda: plot_histograms(records, "param", out / "param_hist.png", labels=labels)),
        ("memory", lambda: plot_memory(records, out / "memory.png")),
    ):
        try:
            drawn.append((caption, draw()))
        except Exception as exc:  # one bad picture never loses the others
            log.warning("trackdiag: could not draw %s: %s", caption, brief(exc))
    images = [(c, p) for c, p in drawn if p is not None]
    if not write_html:
        return [p for _, p in images]
    landscapes = sorted((run_dir / "landscape").glob("*.png"), key=lambda p: p.stat().st_mtime)
    if landscapes:
        images.append((f"loss landscape ({landscapes[-1].stem})", landscapes[-1]))
    run = _json(run_dir / "run.json") or {}
    meta = {"run": run.get("name", run_dir.name), "level": run.get("level", ""),
            "records": len(records), "last step": max((r.step for r in records), default=0)}
    alerts = sorted((a for r in records for a in r.alerts), key=lambda a: a.step)
    severities = {a.severity for a in alerts}
    health = "critical" if "critical" in severities else "warning" if "warning" in severities else "ok"
    page = render_html(run_dir / "report.html", title=f"trackdiag report: {meta['run']}", meta=meta, images=images,
                       alerts=alerts, summaries=summaries, environment=_json(run_dir / "environment.json"),
                       health=health, status=str(run.get("status") or "RUNNING"))
    return [p for _, p in images if p.parent == out] + [page]

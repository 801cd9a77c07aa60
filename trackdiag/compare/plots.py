"""Sweep plots (matplotlib, Agg canvas, imported lazily; no pyplot, so no global backend change).

- ``anomalies_by_param``: per swept parameter, stacked bars of runs raising each alert kind per value.
- ``first_anomaly_vs_param``: first-anomaly step against each swept parameter (log x when numeric
  values span two decades or more); runs without an anomaly sit on a "none" line at the top.
- ``loss_curves``: every run's train loss, coloured by health.

Cost: about 0.3-1 s per figure; the loss plot draws one line per run (500 runs stay under ~2 s).
"""
from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from trackdiag.compare.risk import ParamRisk
from trackdiag.compare.runs import RunSummary
from trackdiag.compare.runs import format_value as _format_value
from trackdiag.compare.safe_read import clip

MAX_LABEL = 24  # tick labels and axis titles: long values end in a hash, so they stay distinct


def format_value(v: Any) -> str:
    """A value as a short tick label."""
    return clip(_format_value(v), MAX_LABEL)

if TYPE_CHECKING:
    from trackdiag.compare.comparison import Comparison

HEALTH_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "failed": "#9467bd", "unknown": "#7f7f7f",
                 "ok": "#2ca02c"}
MAX_PARAMS = 6  # most decisive parameters plotted


def render_plots(comparison: "Comparison") -> dict[str, bytes]:
    """PNG bytes by plot name; parameter plots only when some parameter was swept."""
    risks = comparison.risks[:MAX_PARAMS]
    out: dict[str, bytes] = {}
    if risks:
        out["anomalies_by_param"] = _png(_anomalies_by_param(risks, comparison.kinds))
        out["first_anomaly_vs_param"] = _png(_first_anomaly(comparison.runs, [p.param for p in risks]))
    if any(r.loss_curve for r in comparison.runs):
        out["loss_curves"] = _png(_loss_curves(comparison.runs))
    return out


def _figure(n: int, title: str) -> tuple[Any, list[Any]]:
    """A Figure with ``n`` side-by-side axes (wrapping at 3 per row)."""
    from matplotlib.figure import Figure

    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.6 * cols + 2.2, 3.6 * rows), layout="constrained")  # + legend room
    axes = [fig.add_subplot(rows, cols, i + 1) for i in range(n)]
    fig.suptitle(title)
    return fig, axes


def _anomalies_by_param(risks: list[ParamRisk], kinds: list[str]) -> Any:
    """Stacked bars: runs raising each kind per value, failed runs in grey; ``a/n`` on top."""
    from matplotlib import colormaps

    fig, axes = _figure(len(risks), "Runs raising each alert kind, per value")
    cmap = colormaps["tab10"]
    colors = {k: cmap(i % 10) for i, k in enumerate(kinds)}
    for ax, pr in zip(axes, risks):
        xs = list(range(len(pr.values)))
        bottom = [0.0] * len(xs)
        for k in kinds:
            h = [float(v.kinds.get(k, 0)) for v in pr.values]
            if any(h):
                ax.bar(xs, h, bottom=bottom, color=colors[k], label=k)
                bottom = [b + y for b, y in zip(bottom, h)]
        failed = [float(v.failed) for v in pr.values]
        if any(failed):
            ax.bar(xs, failed, bottom=bottom, color="#bbbbbb", hatch="//", label="failed")
            bottom = [b + y for b, y in zip(bottom, failed)]
        for x, v, b in zip(xs, pr.values, bottom if len(xs) <= 10 else []):  # unreadable beyond ~10
            ax.annotate(f"{v.anomalous}/{v.runs}", (x, b), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [format_value(v.value) for v in pr.values], rotation=30 if len(xs) > 4 else 0)
        ax.set_xlabel(clip(pr.param, 60))
        ax.set_ylabel("runs (stacked by kind)")
        ax.set_ylim(0, max(bottom + [1.0]) * 1.2)
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8)
    return fig


def _first_anomaly(runs: list[RunSummary], params: list[str]) -> Any:
    """First-anomaly step vs each parameter; runs without one on a 'none' line above the rest."""
    fig, axes = _figure(len(params), "First anomaly step vs swept parameter")
    runs = [r for r in runs if r.hparams]
    steps = [r.first_anomaly for r in runs if r.first_anomaly is not None]
    top = max(steps + [r.steps or 0 for r in runs] + [1]) * 1.08
    for ax, p in zip(axes, params):
        values = [r.hparams.get(p) for r in runs]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric:
            xs = [float(v) for v in values]  # type: ignore[arg-type]
            pos = [x for x in xs if x > 0]
            if len(pos) == len(xs) and max(pos) / min(pos) >= 100:
                ax.set_xscale("log")
        else:
            labels = sorted({format_value(v) for v in values})
            index = {lab: i for i, lab in enumerate(labels)}
            xs = [index[format_value(v)] for v in values]
            ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 4 else 0)
        groups: dict[tuple[str, bool, bool], list[tuple[float, float]]] = {}
        for x, r in zip(xs, runs):  # one scatter call per style, not per run
            y = r.first_anomaly if r.first_anomaly is not None else top
            key = (r.display_health, r.first_anomaly is None, r.failed)
            groups.setdefault(key, []).append((x, y))
        for (health, hollow, failed), pts in groups.items():
            color = HEALTH_COLORS.get(health, "k")
            gx, gy = zip(*pts)
            if hollow and failed:
                ax.scatter(gx, gy, s=40, marker="x", color=color)
            else:
                ax.scatter(gx, gy, s=36, marker="o", facecolors="none" if hollow else color, edgecolors=color,
                           linewidths=1.2)
        ax.axhline(top, color="#cccccc", lw=0.8, ls="--", zorder=0)
        ax.annotate("none", (0.01, top), xycoords=("axes fraction", "data"), va="bottom", fontsize=7,
                    color="#888888")
        ax.set_xlabel(clip(p, 60))
        ax.set_ylabel("first anomaly step")
        ax.set_ylim(0, top * 1.1)
    _health_legend(fig, present={r.display_health for r in runs})
    return fig


def _loss_curves(runs: list[RunSummary]) -> Any:
    """Train loss of every run coloured by health; log y when positive values span 2+ decades."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    alpha = 0.85 if len(runs) <= 20 else max(0.15, 20 / len(runs))
    finite = [v for r in runs for _, v in r.loss_curve if math.isfinite(v)]
    order = sorted(runs, key=lambda r: -r.sort_key()[0])  # severe runs drawn last, on top
    for r in order:
        if r.loss_curve:
            xs, ys = zip(*r.loss_curve)
            ax.plot(xs, ys, color=HEALTH_COLORS.get(r.display_health, "k"), lw=1.1, alpha=alpha)
    title = "Loss curves by health"
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 100:
        ax.set_yscale("log")
        starts = sorted(v for r in runs for _, v in r.loss_curve[:1] if math.isfinite(v) and v > 0)
        cap = 1e3 * starts[len(starts) // 2] if starts else math.inf
        if max(finite) > cap:  # a diverged run would squash every other curve to a flat line
            ax.set_ylim(top=cap)
            title += " (y clipped at 1000x the median initial loss)"
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (diag/loss)")
    ax.set_title(title)
    _health_legend(fig, present={r.display_health for r in runs})
    return fig


def _health_legend(fig: Any, present: set[str] | None = None) -> None:
    """One legend entry per health colour."""
    from matplotlib.lines import Line2D

    names = [h for h in HEALTH_COLORS if present is None or h in present]
    handles = [Line2D([], [], color=HEALTH_COLORS[h], marker="o", lw=2, label=h) for h in names]
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, title="health")


def _png(fig: Any) -> bytes:
    """Render a Figure to PNG bytes through the Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()

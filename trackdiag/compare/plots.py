"""Sweep plots (matplotlib, Agg canvas, imported lazily; no pyplot, so no global backend change).

- ``anomalies_by_param``: per swept parameter and value, the runs (grey outline), the anomalous ones
  stacked by the kind of their first alert, then the runs that failed without an alert (hatched):
  each run counted once, so a stack never exceeds its runs (a run that crashed after an alert is
  anomalous, not also failed); ``a/n`` on top; a sweep where nothing fired says so in the plot.
- ``first_anomaly_vs_param``: first-anomaly step against each swept parameter (log x when numeric
  values span two decades or more); runs without an anomaly sit in a grey "no anomaly" band above
  the longest run, never at a step of their own.
- ``loss_curves``: every run's train loss, one colour per run (by the most decisive parameter's value
  when there are many), its first anomaly marked with an x; a legend names each run.

Runs without trackdiag have nothing to plot and are left out. Cost: about 0.3-1 s per figure; the
loss plot draws one line per run (500 runs stay under ~2 s).
"""
from __future__ import annotations

import io
import math
from typing import TYPE_CHECKING, Any

from trackdiag.compare.risk import ParamRisk
from trackdiag.compare.runs import MISSING, RunSummary, is_setting
from trackdiag.compare.runs import format_value as _format_value
from trackdiag.compare.safe_read import clip

MAX_LABEL = 24  # tick labels and axis titles: long values end in a hash, so they stay distinct
MAX_LEGEND_RUNS = 12  # beyond this, loss curves are coloured by parameter value with a colour bar


def format_value(v: Any) -> str:
    """A value as a short tick label; a float keeps its point (``lr=1.0`` reads ``1.0``, not ``1``)."""
    text = _format_value(v)
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and text.lstrip("-").isdigit():
        text += ".0"
    return clip(text, MAX_LABEL)


if TYPE_CHECKING:
    from trackdiag.compare.comparison import Comparison

HEALTH_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "failed": "#9467bd", "unknown": "#7f7f7f",
                 "ok": "#2ca02c"}
MAX_PARAMS = 6  # most decisive parameters plotted
#: one colour per run in a legend: no pure red or green, which read as health
RUN_COLORS = ["#1f77b4", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22", "#393b79",
              "#843c39", "#637939", "#000000"]


def render_plots(comparison: "Comparison") -> dict[str, bytes]:
    """PNG bytes by plot name; parameter plots only when some parameter was swept."""
    risks = comparison.risks[:MAX_PARAMS]
    runs = [r for r in comparison.runs if r.diagnosed]
    out: dict[str, bytes] = {}
    if risks:
        out["anomalies_by_param"] = _png(_anomalies_by_param(risks, runs))
        out["first_anomaly_vs_param"] = _png(_first_anomaly(runs, [p.param for p in risks]))
    if any(r.loss_curve for r in runs):
        out["loss_curves"] = _png(_loss_curves(runs, risks[0].param if risks else None))
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


def _failed_only(runs: list[RunSummary], param: str) -> dict[str, int]:
    """``repr(value)`` -> runs with that value of ``param`` that failed without an anomaly (grouped as
    ``param_risk`` groups them: runs without a trackdiag setting have no value for it)."""
    out: dict[str, int] = {}
    for r in runs:
        if r.hparams and r.failed and not r.anomalous and not (is_setting(param) and param not in r.hparams):
            key = repr(r.hparams.get(param, MISSING))
            out[key] = out.get(key, 0) + 1
    return out


def _anomalies_by_param(risks: list[ParamRisk], runs: list[RunSummary]) -> Any:
    """Per value: runs (outline), anomalous runs stacked by first alert kind, then the runs that failed
    without an alert (hatched); each run counted once; ``a/n`` on top."""
    from matplotlib import colormaps

    fig, axes = _figure(len(risks), "Anomalous runs per value")
    firsts = list(dict.fromkeys(k for pr in risks for v in pr.values for k in sorted(v.first_kinds)))
    cmap = colormaps["tab10"]
    colors = {k: cmap(i % 10) for i, k in enumerate(firsts)}
    quiet = not any(v.anomalous or v.failed for pr in risks for v in pr.values)
    for ax, pr in zip(axes, risks):
        xs = list(range(len(pr.values)))
        totals = [float(v.runs) for v in pr.values]
        ax.bar(xs, totals, color="none", edgecolor="#999999", lw=1.0, label="runs with this value")
        bottom = [0.0] * len(xs)
        for k in firsts:
            h = [float(v.first_kinds.get(k, 0)) for v in pr.values]
            if any(h):
                ax.bar(xs, h, bottom=bottom, color=colors[k], label=f"first alert: {k}", width=0.6)
                bottom = [b + y for b, y in zip(bottom, h)]
        other = [float(v.anomalous - sum(v.first_kinds.values())) for v in pr.values]  # health without kinds
        if any(o > 0 for o in other):
            ax.bar(xs, other, bottom=bottom, color="#bbbbbb", label="anomalous (kind unknown)", width=0.6)
            bottom = [b + max(y, 0.0) for b, y in zip(bottom, other)]
        failed_only = _failed_only(runs, pr.param)
        failed = [float(failed_only.get(repr(v.value), 0)) for v in pr.values]
        if any(failed):
            ax.bar(xs, failed, bottom=bottom, color="#eedff5", edgecolor=HEALTH_COLORS["failed"], hatch="//",
                   label="failed, no alert before", width=0.6)
        for x, v, n in zip(xs, pr.values, totals if len(xs) <= 12 else []):  # unreadable beyond ~12
            ax.annotate(f"{v.anomalous}/{v.runs}", (x, n), ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [format_value(v.value) for v in pr.values], rotation=30 if len(xs) > 4 else 0)
        ax.set_xlabel(clip(pr.param, 60))
        ax.set_ylabel("runs")
        ax.set_ylim(0, max(totals + [1.0]) * 1.25)
        ax.yaxis.get_major_locator().set_params(integer=True)
        if quiet:
            ax.text(0.5, 0.55, "no run raised a warning\nor critical alert", transform=ax.transAxes, ha="center",
                    va="center", fontsize=11, color="#2ca02c")
    handles = {lab: h for ax in axes for h, lab in zip(*ax.get_legend_handles_labels())}
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside right upper", fontsize=8,
                   title="anomalous runs by\ntheir first alert", title_fontsize=8)
    return fig


def _first_anomaly(runs: list[RunSummary], params: list[str]) -> Any:
    """First-anomaly step vs each parameter; runs without one in a 'no anomaly' band above the rest."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(len(params), "First anomaly step vs swept parameter")
    runs = [r for r in runs if r.hparams]
    longest = max([r.first_anomaly for r in runs if r.first_anomaly is not None] + [r.steps or 0 for r in runs] + [1])
    band = longest * 1.12  # where runs without an anomaly are drawn: above every real step
    for ax, p in zip(axes, params):
        here = [r for r in runs if p in r.hparams or not p.startswith(("diag.", "trackdiag."))]
        values = [r.hparams.get(p, MISSING) for r in here]
        numeric = bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric:
            xs = [float(v) for v in values]  # type: ignore[arg-type]
            pos = [x for x in xs if x > 0]
            if len(pos) == len(xs) and max(pos) / min(pos) >= 100:
                ax.set_xscale("log")
            if len(set(xs)) <= 12:  # the swept values themselves as ticks (no 0.2, 0.4 ... for seed=0,1)
                ax.set_xticks(sorted(set(xs)), [format_value(v) for v in sorted(set(values), key=float)])
                ax.minorticks_off()
        else:
            labels = sorted({format_value(v) for v in values})
            index = {lab: i for i, lab in enumerate(labels)}
            xs = [index[format_value(v)] for v in values]
            ax.set_xticks(range(len(labels)), labels, rotation=30 if len(labels) > 4 else 0)
        groups: dict[tuple[str, bool, bool], list[tuple[float, float]]] = {}
        for x, r in zip(xs, here):  # one scatter call per style, not per run
            y = r.first_anomaly if r.first_anomaly is not None else band
            groups.setdefault((r.display_health, r.first_anomaly is None, r.failed), []).append((x, y))
        for (health, hollow, failed), pts in groups.items():
            color = HEALTH_COLORS.get(health, "k")
            gx, gy = zip(*pts)
            if hollow and failed:
                ax.scatter(gx, gy, s=40, marker="x", color=color, zorder=3)
            else:
                ax.scatter(gx, gy, s=36, marker="o", facecolors="none" if hollow else color, edgecolors=color,
                           linewidths=1.2, zorder=3)
        ax.axhspan(longest * 1.04, longest * 1.2, color="#eeeeee", zorder=0)
        ticks = [t for t in MaxNLocator(nbins=5, integer=True).tick_values(0, longest) if 0 <= t <= longest]
        ax.set_yticks(ticks + [band], [f"{t:g}" for t in ticks] + ["no\nanomaly"])
        ax.set_xlabel(clip(p, 60))
        ax.set_ylabel("first anomaly step")
        ax.set_ylim(0, longest * 1.2)
    _health_legend(fig, present={r.display_health for r in runs})
    return fig


def _loss_curves(runs: list[RunSummary], param: str | None) -> Any:
    """Train loss of every run, one colour per run, first anomaly marked; log y when positive values
    span 2+ decades."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(9.5, 4.8), layout="constrained")
    ax = fig.add_subplot(1, 1, 1)
    drawn = [r for r in runs if r.loss_curve]
    many = len(drawn) > MAX_LEGEND_RUNS
    colors, scale = _run_colors(drawn, param, many)
    alpha = 0.9 if not many else max(0.2, MAX_LEGEND_RUNS / len(drawn))
    finite = [v for r in drawn for _, v in r.loss_curve if math.isfinite(v)]
    marks: list[tuple[int, float, Any]] = []
    for r in sorted(drawn, key=lambda r: -r.sort_key()[0]):  # severe runs drawn last, on top
        xs, ys = zip(*r.loss_curve)
        value = f" {param}={format_value(r.hparams.get(param, MISSING))}" if param else ""
        ax.plot(xs, ys, color=colors[id(r)], lw=1.6 if r.anomalous else 1.0, alpha=alpha,
                label=None if many else f"{r.label}{value} ({r.display_health})")
        if r.first_anomaly is not None:
            at = min(r.loss_curve, key=lambda p: abs(p[0] - r.first_anomaly))  # type: ignore[operator]
            marks.append((r.first_anomaly, at[1], colors[id(r)]))
    title = "Loss curves (X: first anomaly)"
    cap = max(finite) if finite else 1.0
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 100:
        ax.set_yscale("log")
        starts = sorted(v for r in drawn for _, v in r.loss_curve[:1] if math.isfinite(v) and v > 0)
        if starts and max(finite) > 1e3 * starts[len(starts) // 2]:  # a diverged run would squash the others flat
            cap = 1e3 * starts[len(starts) // 2]
            ax.set_ylim(top=cap)
            title += ", y clipped at 1000x the median initial loss"
    for step, y, color in marks:  # a non-finite or clipped loss: the mark sits at the top edge
        ax.scatter([step], [min(y, cap) if math.isfinite(y) else cap], marker="X", s=60, color=color, edgecolors="k",
                   linewidths=0.6, zorder=4, clip_on=False)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (diag/loss)")
    ax.set_title(title)
    if not many:
        handles, labels = ax.get_legend_handles_labels()
        handles.append(Line2D([], [], marker="X", color="w", markerfacecolor="#777777", markeredgecolor="k", ms=8))
        labels.append("first anomaly")
        fig.legend(handles, labels, loc="outside right upper", fontsize=8, title="run (health)")
    elif scale is not None:
        fig.colorbar(scale, ax=ax, label=clip(param or "", 60))
    else:
        _health_legend(fig, present={r.display_health for r in drawn})
    return fig


def _run_colors(runs: list[RunSummary], param: str | None, many: bool) -> tuple[dict[int, Any], Any]:
    """A colour per run: distinct colours for a legend of few runs; by ``param``'s value (a colour bar
    when numeric) for many; by health when there is no parameter. Returns (colours by id, mappable)."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm, Normalize

    if not many:
        order = sorted(runs, key=lambda r: (_sortable(r.hparams.get(param, MISSING)) if param else (0, 0.0, ""), r.label))
        return {id(r): RUN_COLORS[i % len(RUN_COLORS)] for i, r in enumerate(order)}, None
    values = [r.hparams.get(param, MISSING) for r in runs] if param else []
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if param and len(nums) == len(values) and len(set(nums)) > 1:
        lo, hi = min(nums), max(nums)
        norm = LogNorm(lo, hi) if lo > 0 and hi / lo >= 100 else Normalize(lo, hi)
        cmap = colormaps["viridis"]
        return {id(r): cmap(norm(v)) for r, v in zip(runs, values)}, ScalarMappable(norm=norm, cmap=cmap)
    return {id(r): HEALTH_COLORS.get(r.display_health, "k") for r in runs}, None


def _sortable(v: Any) -> tuple[int, float, str]:
    """Numbers first, ascending; then anything else by its text."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return 0, float(v), ""
    return 1, 0.0, str(v)


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

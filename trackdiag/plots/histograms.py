"""Histogram heat-maps over steps: one panel per layer group (x: one column per logged step, y: value,
colour: log count; red marks: values clamped into the end bins, NaN/Inf included).

Reads ``record.histograms["diag/[<c>/]<grad|param>/hist/<group>"]`` (the ``histograms`` probe).
Panels keep forward order; beyond ``max_panels`` groups, an even selection that keeps the first
and last. Histograms whose edges differ from the series' first (a resumed run with other options)
are re-binned by bin centre onto the first edges. Cost: ~0.3 s for 3 panels, ~0.45 s for 12 (fixed margins: the
constrained layout it had cost as much again).
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

import numpy as np

from trackdiag.core.record import Record
from trackdiag.plots import figure, save, split_key

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def collect(records: Iterable[Record], family: str) -> dict[str, tuple[np.ndarray, list[int], np.ndarray]]:
    """``"<comp>/<group>"`` (or ``<group>``) -> (edges, steps, counts[steps, bins]) for ``family``."""
    series: dict[str, tuple[np.ndarray, list[int], list[np.ndarray]]] = {}
    for r in records:
        for key, h in r.histograms.items():
            parts = split_key(key, family, "hist")
            if parts is None:
                continue
            name = f"{parts[0]}/{parts[1]}" if parts[0] else parts[1]
            edges, counts = np.asarray(h.edges, dtype=float), np.asarray(h.counts, dtype=float)
            if name not in series:
                series[name] = (edges, [], [])
            first, steps, rows = series[name]
            if edges.shape != first.shape or not np.allclose(edges, first):
                centres = np.clip((edges[1:] + edges[:-1]) / 2, first[0], first[-1])
                counts, _ = np.histogram(centres, bins=first, weights=counts)
            steps.append(r.step)
            rows.append(counts)
    out = {}
    for k, (e, steps, rows) in series.items():
        by_step = dict(zip(steps, rows))  # a step logged twice (resumed run): keep the last
        order = sorted(by_step)
        out[k] = (e, order, np.vstack([by_step[s] for s in order]))
    return out


def pick(names: list[str], n: int) -> list[str]:
    """At most ``n`` names, evenly spread, first and last kept."""
    if len(names) <= n:
        return names
    idx = sorted({round(i * (len(names) - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]
    return [names[i] for i in idx]


def clipped_shares(records: Iterable[Record], family: str) -> dict[str, dict[int, float]]:
    """``"<comp>/<group>"`` -> step -> share of the values outside the fixed edges (NaN/Inf included),
    from the probe's ``diag/[<c>/]<family>/hist_clipped`` tables and the histograms' totals."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for key, h in r.histograms.items():
            parts = split_key(key, family, "hist")
            if parts is None:
                continue
            table = r.tables.get(f"diag/{parts[0]}/{family}/hist_clipped" if parts[0] else f"diag/{family}/hist_clipped", {})
            total = float(sum(h.counts))
            if parts[1] in table and total > 0:
                name = f"{parts[0]}/{parts[1]}" if parts[0] else parts[1]
                out.setdefault(name, {})[r.step] = float(table[parts[1]]) / total
    return out


def plot_histograms(records: Iterable[Record], family: str, path: str | Path, *, max_panels: int = 12,
                    labels: Mapping[str, str] | None = None) -> Path | None:
    """Draw the ``family`` (``grad`` | ``param``) histogram heat-maps to ``path`` (:func:`histogram_figure`);
    None without data."""
    fig = histogram_figure(records, family, max_panels=max_panels, labels=labels)
    return None if fig is None else save(fig, path)


def histogram_figure(records: Iterable[Record], family: str, *, max_panels: int = 12,
                     labels: Mapping[str, str] | None = None) -> "Figure | None":
    """The ``family`` (``grad`` | ``param``) histogram heat-maps as a figure; None without data.

    One column per logged histogram (the steps are log-spaced early in a run, so equal-width columns
    labelled with their step show every one); columns where more than 1 % of the values fell outside
    the fixed edges (clamped into the end bins: values that grew out of range, NaN/Inf) get a red mark
    with the share. ``labels`` maps a group name to its panel title (``0 (Linear)``)."""
    records = list(records)
    data = collect(records, family)
    if not data:
        return None
    clipped = clipped_shares(records, family)
    labels = labels or {}
    names = pick(list(data), max_panels)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    width, height = 4.4 * cols + 0.8, 2.9 * rows + 0.5
    fig = figure(width, height, layout=None)
    family_name = "gradient" if family == "grad" else "parameter"
    title = f"{family_name} value histograms per layer group over steps"
    if any(v > 0.01 for shares in clipped.values() for v in shares.values()):
        title += "; red: share of values outside the range of the first histogram (clamped; NaN/Inf included)"
    title = textwrap.fill(title, int((width - 0.3) / _CHAR_W))  # one or two columns: two or three lines
    top_margin = _TOP + _LINE_H * title.count("\n")
    axes = fig.subplots(rows, cols, squeeze=False, gridspec_kw=_grid(width, height, rows, cols, top_margin))
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    image = None
    for ax, name in zip(axes.flat, names):
        edges, steps, counts = data[name]
        x = np.arange(len(steps) + 1) - 0.5
        image = ax.pcolormesh(x, edges, np.log10(1 + counts.T), cmap="viridis", shading="flat")
        if edges[0] < 0 < edges[-1] and _log_spaced(edges):
            ax.set_yscale("symlog", linthresh=float(np.min(np.abs(edges[edges != 0]))))
        shares = clipped.get(name, {})
        bad = [(i, shares[s]) for i, s in enumerate(steps) if shares.get(s, 0.0) > 0.01]
        if bad:
            ax.scatter([i for i, _ in bad], [edges[-1]] * len(bad), marker="v", color="#ff3b30", s=28, zorder=3,
                       clip_on=False)
            for i, share in bad[:12]:
                ax.annotate(f"{share:.0%}", (i, edges[-1]), xytext=(0, 5), textcoords="offset points", ha="center",
                            fontsize=6, color="#cb181d", annotation_clip=False)
        ax.set_xlim(-0.5, len(steps) - 0.5)
        every = max(1, math.ceil(len(steps) / 8))
        ticks = list(range(0, len(steps), every))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
        ax.set_title(labels.get(name, name), fontsize=9, pad=12 if bad else 4)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step (one column per histogram)", fontsize=8)
    if image is not None:
        top, bottom = 1 - top_margin / height, _BOTTOM / height
        bar = fig.add_axes((1 - (_RIGHT - 0.35) / width, bottom + 0.1 * (top - bottom), 0.16 / width, 0.8 * (top - bottom)))
        fig.colorbar(image, cax=bar, label="log10(1 + count)")
    fig.suptitle(title, fontsize=10)
    return fig


#: the margins and gaps around the panels, in inches: room for the y tick labels (up to ~8 characters at size 7, or
#: a symlog axis' powers of ten), a panel's title (with the red marks' shares above it), its x label and ticks, the
#: suptitle, and the colour bar with its ticks and label at the right. Fixed, not measured: constrained layout
#: measured every tick label of every panel twice, ~0.5 s of a 12-panel picture's ~0.9 s.
_LEFT, _RIGHT, _TOP, _BOTTOM, _GAP_W, _GAP_H = 0.75, 1.3, 0.72, 0.5, 0.8, 0.85
#: the suptitle's average character width and line height at size 10, in inches (it is wrapped to the picture)
_CHAR_W, _LINE_H = 0.08, 0.19


def _grid(width: float, height: float, rows: int, cols: int, top: float = _TOP) -> dict[str, float]:
    """``subplots`` gridspec arguments that place a ``rows`` x ``cols`` grid of panels in a ``width`` x ``height``
    inch figure with the margins and gaps above (``wspace``/``hspace`` are fractions of a panel's size)."""
    inner_w, inner_h = width - _LEFT - _RIGHT, height - top - _BOTTOM
    panel_w, panel_h = (inner_w - (cols - 1) * _GAP_W) / cols, (inner_h - (rows - 1) * _GAP_H) / rows
    return {"left": _LEFT / width, "right": 1 - _RIGHT / width, "bottom": _BOTTOM / height, "top": 1 - top / height,
            "wspace": _GAP_W / panel_w, "hspace": _GAP_H / panel_h}


def _log_spaced(edges: np.ndarray) -> bool:
    widths = np.diff(edges)
    return bool(widths.max() > 10 * widths.min())

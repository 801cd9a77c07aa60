"""Histogram heat-maps over steps: one panel per layer group (x: one column per logged step, y: value,
colour: log count; red marks: values clamped into the end bins, NaN/Inf included).

Reads ``record.histograms["diag/[<c>/]<grad|param>/hist/<group>"]`` (the ``histograms`` probe).
Panels keep forward order; beyond ``max_panels`` groups, an even selection that keeps the first
and last. Histograms whose edges differ from the series' first (a resumed run with other options)
are re-binned by bin centre onto the first edges. Cost: a few hundred ms per figure.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from trackdiag.core.record import Record
from trackdiag.plots import figure, save, split_key


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
    """Draw the ``family`` (``grad`` | ``param``) histogram heat-maps to ``path``; None without data.

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
    fig = figure(4.4 * cols + 0.8, 2.9 * rows + 0.5)
    axes = fig.subplots(rows, cols, squeeze=False)
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
        fig.colorbar(image, ax=axes, shrink=0.8, label="log10(1 + count)")
    title = "gradient" if family == "grad" else "parameter"
    marks = "; red: share of values outside the range of the first histogram (clamped; NaN/Inf included)"
    fig.suptitle(f"{title} value histograms per layer group over steps"
                 + (marks if any(v > 0.01 for shares in clipped.values() for v in shares.values()) else ""), fontsize=10)
    return save(fig, path)


def _log_spaced(edges: np.ndarray) -> bool:
    widths = np.diff(edges)
    return bool(widths.max() > 10 * widths.min())

"""Histogram heat-maps over steps: one panel per layer group (x: step, y: value, colour: log count).

Reads ``record.histograms["diag/[<c>/]<grad|param>/hist/<group>"]`` (the ``histograms`` probe).
Panels keep forward order; beyond ``max_panels`` groups, an even selection that keeps the first
and last. Histograms whose edges differ from the series' first (a resumed run with other options)
are re-binned by bin centre onto the first edges. Cost: a few hundred ms per figure.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np

from trackdiag.plots import figure, save, split_key
from trackdiag.record import Record


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


def plot_histograms(records: Iterable[Record], family: str, path: str | Path, *, max_panels: int = 12) -> Path | None:
    """Draw the ``family`` (``grad`` | ``param``) histogram heat-maps to ``path``; None without data."""
    data = collect(records, family)
    if not data:
        return None
    names = pick(list(data), max_panels)
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig = figure(4.2 * cols, 2.6 * rows + 0.4)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    image = None
    for ax, name in zip(axes.flat, names):
        edges, steps, counts = data[name]
        x = _step_edges(steps)
        image = ax.pcolormesh(x, edges, np.log10(1 + counts.T), cmap="viridis", shading="flat")
        if edges[0] < 0 < edges[-1] and _log_spaced(edges):
            ax.set_yscale("symlog", linthresh=float(np.min(np.abs(edges[edges != 0]))))
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("step", fontsize=8)
    if image is not None:
        fig.colorbar(image, ax=axes, shrink=0.8, label="log10(1 + count)")
    title = "gradient" if family == "grad" else "parameter"
    fig.suptitle(f"{title} value histograms per layer group over steps", fontsize=11)
    return save(fig, path)


def _step_edges(steps: list[int]) -> np.ndarray:
    """Cell boundaries around each logged step (cells meet half-way between steps)."""
    s = np.asarray(steps, dtype=float)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2
    return np.concatenate([[s[0] - (mid[0] - s[0])], mid, [s[-1] + (s[-1] - mid[-1])]])


def _log_spaced(edges: np.ndarray) -> bool:
    widths = np.diff(edges)
    return bool(widths.max() > 10 * widths.min())

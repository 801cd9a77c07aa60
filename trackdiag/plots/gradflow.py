"""Gradient flow: per-layer gradient norm bars in forward order (the classic ``plot_grad_flow``).

Reads the per-layer gradient norms of the ``grads`` probe: the full table
``record.tables["diag/[<c>/]grad/norm"]`` when layers were coarsened, else the scalars
``diag/[<c>/]grad/norm/<layer>``. For each layer: the max over the logged steps (light bar) and
the mean (dark bar), log scale. Highlighted: vanishing layers (mean below ``vanishing`` or
``relative`` times below the median layer) in blue, exploding ones (max above ``exploding`` or
``relative`` times above the median) in red, non-finite ones as a red cross.
Cost: one pass over the records and one figure (~100-300 ms).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np

from trackdiag.plots import figure, save, split_key
from trackdiag.record import Record


def layer_norms(records: Iterable[Record]) -> dict[str, dict[str, list[float]]]:
    """component -> layer (forward order) -> the layer's gradient norm at each logged step."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in records:
        tabled = set()
        for name, table in r.tables.items():
            if name == "diag/grad/norm" or (name.startswith("diag/") and name.endswith("/grad/norm")):
                comp = name[len("diag/"):-len("/grad/norm")] if name != "diag/grad/norm" else ""
                tabled.add(comp)
                for layer, v in table.items():
                    out.setdefault(comp, {}).setdefault(layer, []).append(v)
        for key, v in r.scalars.items():
            parts = split_key(key, "grad", "norm")
            if parts is not None and parts[0] not in tabled:
                out.setdefault(parts[0], {}).setdefault(parts[1], []).append(v)
    return out


def classify(mean: np.ndarray, peak: np.ndarray, vanishing: float, exploding: float, relative: float) -> list[str]:
    """Per layer: ``"vanishing"``, ``"exploding"``, ``"nonfinite"`` or ``""``."""
    finite = np.isfinite(mean) & np.isfinite(peak)
    median = float(np.median(mean[finite])) if finite.any() else math.nan
    out = []
    for m, p, ok in zip(mean, peak, finite):
        if not ok:
            out.append("nonfinite")
        elif p > exploding or (median > 0 and p > relative * median):
            out.append("exploding")
        elif m < vanishing or (median > 0 and m < median / relative):
            out.append("vanishing")
        else:
            out.append("")
    return out


def plot_grad_flow(records: Iterable[Record], path: str | Path, *, vanishing: float = 1e-7, exploding: float = 100.0,
                   relative: float = 1e3) -> Path | None:
    """Draw the gradient flow of every component to ``path``; None when no per-layer norms were logged."""
    data = layer_norms(records)
    if not data:
        return None
    n_max = max(len(layers) for layers in data.values())
    fig = figure(min(4 + 0.18 * n_max, 22), 3.6 * len(data) + 0.6)
    axes = fig.subplots(len(data), 1, squeeze=False)[:, 0]
    colours = {"": ("#9ecae1", "#3182bd"), "vanishing": ("#c6dbef", "#08519c"),
               "exploding": ("#fcbba1", "#cb181d"), "nonfinite": ("#fcbba1", "#cb181d")}
    for ax, (comp, layers) in zip(axes, data.items()):
        names = list(layers)
        vals = [np.asarray(v, dtype=float) for v in layers.values()]
        peak = np.array([np.max(np.where(np.isfinite(v), v, np.inf)) for v in vals])
        mean = np.array([np.mean(v) for v in vals])
        kinds = classify(mean, peak, vanishing, exploding, relative)
        x = np.arange(len(names))
        floor = max(min([v for v in np.concatenate([mean, peak]) if np.isfinite(v) and v > 0], default=1e-12) / 10, 1e-30)
        safe = lambda a: np.where(np.isfinite(a) & (a > 0), a, floor)  # noqa: E731
        ax.bar(x, safe(peak), color=[colours[k][0] for k in kinds], width=0.8, label="max over steps")
        ax.bar(x, safe(mean), color=[colours[k][1] for k in kinds], width=0.5, label="mean over steps")
        bad = [i for i, k in enumerate(kinds) if k == "nonfinite"]
        if bad:
            ax.scatter(bad, [floor] * len(bad), marker="x", color="#cb181d", s=60, label="non-finite", zorder=3)
        ax.set_yscale("log")
        ax.axhline(exploding, color="#cb181d", ls="--", lw=0.8)
        ax.axhline(vanishing, color="#08519c", ls="--", lw=0.8)
        ax.set_ylim(bottom=floor)
        ax.set_xticks(x, names, rotation=90 if len(names) > 8 else 0, fontsize=7)
        for tick, k in zip(ax.get_xticklabels(), kinds):
            if k:
                tick.set_color(colours[k][1])
                tick.set_fontweight("bold")
        flagged = sum(bool(k) for k in kinds)
        title = f"gradient flow{f' — {comp}' if comp else ''}: L2 norm per layer, forward order"
        ax.set_title(title + (f" ({flagged} flagged)" if flagged else ""), fontsize=10)
        ax.set_ylabel("grad norm", fontsize=8)
        ax.legend(fontsize=7, loc="upper right")
    return save(fig, path)

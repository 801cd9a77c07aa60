"""Gradient flow: per-layer gradient norm bars in forward order (the classic ``plot_grad_flow``).

Reads the per-layer gradient norms of the ``grads`` probe: the full table
``record.tables["diag/[<c>/]grad/norm"]`` when layers were coarsened, else the scalars
``diag/[<c>/]grad/norm/<layer>``. For each layer: the max over the logged steps (light bar) and
the mean (dark bar), log scale. Highlighted: vanishing layers (mean below ``vanishing`` or
``relative`` times below the median layer) in blue, exploding ones (max above ``exploding`` or
``relative`` times above the median) in red; a layer with NaN/Inf norms keeps the bars of its finite
steps, in red, with a cross and the count of non-finite steps under its name.
Cost: one pass over the records and one figure (~100-300 ms).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from trackdiag.core.record import Record
from trackdiag.plots import figure, save, split_key


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
                   relative: float = 1e3, labels: Mapping[str, str] | None = None) -> Path | None:
    """Draw the gradient flow of every component to ``path``; None when no per-layer norms were logged.

    Bars use the finite steps of each layer (a layer that went NaN/Inf keeps the bars of its finite
    steps, red, with a cross on top and ``n/N non-finite`` under its name). ``labels`` maps a layer name
    (``<component>/<layer>`` for named components) to its tick label (``0 (Linear)``)."""
    data = layer_norms(records)
    if not data:
        return None
    labels = labels or {}
    n_max = max(len(layers) for layers in data.values())
    fig = figure(min(max(7.0, 2.5 + 0.32 * n_max), 22), 4.0 * len(data) + 0.6)
    axes = fig.subplots(len(data), 1, squeeze=False)[:, 0]
    colours = {"": ("#9ecae1", "#3182bd"), "vanishing": ("#c6dbef", "#08519c"),
               "exploding": ("#fcbba1", "#cb181d"), "nonfinite": ("#fcbba1", "#cb181d")}
    for ax, (comp, layers) in zip(axes, data.items()):
        names = list(layers)
        vals = [np.asarray(v, dtype=float) for v in layers.values()]
        bad_steps = [int(np.sum(~np.isfinite(v))) for v in vals]
        finite = [v[np.isfinite(v)] for v in vals]
        peak = np.array([np.max(f) if f.size else math.nan for f in finite])
        mean = np.array([np.mean(f) if f.size else math.nan for f in finite])
        kinds = ["nonfinite" if b else k for b, k in zip(bad_steps, classify(mean, peak, vanishing, exploding, relative))]
        x = np.arange(len(names))
        positive = [v for v in np.concatenate([mean, peak]) if np.isfinite(v) and v > 0]
        floor = max(min(positive + [exploding, vanishing]) / 10, 1e-30)
        top = max(positive + [exploding]) * 10
        safe = lambda a: np.where(np.isfinite(a) & (a > 0), a, floor)  # noqa: E731
        ax.bar(x, safe(peak), color=[colours[k][0] for k in kinds], width=0.8, label="max over finite steps")
        ax.bar(x, safe(mean), color=[colours[k][1] for k in kinds], width=0.5, label="mean over finite steps")
        bad = [i for i, k in enumerate(kinds) if k == "nonfinite"]
        if bad:
            ax.scatter(bad, [top / 3] * len(bad), marker="X", color="#cb181d", s=70, label="NaN/Inf at some steps",
                       zorder=3)
        ax.set_yscale("log")
        ax.axhline(exploding, color="#cb181d", ls="--", lw=0.8, label=f"exploding above {exploding:g}")
        ax.axhline(vanishing, color="#08519c", ls="--", lw=0.8, label=f"vanishing below {vanishing:g}")
        ax.set_ylim(floor, top)
        ticks = [labels.get(f"{comp}/{n}" if comp else n, n) for n in names]
        ticks = [f"{t}\n{b}/{len(v)} NaN/Inf" if b else t for t, b, v in zip(ticks, bad_steps, vals)]
        ax.set_xticks(x, ticks, rotation=90 if len(names) > 8 else 0, fontsize=7)
        for tick, k in zip(ax.get_xticklabels(), kinds):
            if k:
                tick.set_color(colours[k][1])
                tick.set_fontweight("bold")
        flagged = {k: sum(1 for q in kinds if q == k) for k in ("nonfinite", "exploding", "vanishing")}
        words = {"nonfinite": "with NaN/Inf", "exploding": "exploding", "vanishing": "vanishing"}
        note = ", ".join(f"{n} {words[k]}" for k, n in flagged.items() if n)
        ax.set_title(f"gradient flow{f' — {comp}' if comp else ''}: L2 norm per layer, input to output"
                     + (f"\nflagged layers: {note}" if note else ""), fontsize=10, loc="left")
        ax.set_ylabel("grad norm", fontsize=8)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # never over a bar
    return save(fig, path)

"""Loss landscape pictures: a 1-D slice, or a 2-D contour with the slice through the centre.

``save_landscape(result, out_dir, stem)`` writes ``<stem>.json`` (grid, losses, options) and
``<stem>.png`` and returns both paths. Cost: one figure (~200-400 ms); no model work.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from trackdiag.forensics.landscape import Landscape
from trackdiag.plots import figure, save


def _arr(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=float)  # "nan"/"inf" strings from JSON parse as floats too


def plot_landscape(data: dict[str, Any], path: str | Path) -> Path:
    """Draw a landscape dict (``Landscape.to_dict()`` or its JSON) to ``path``."""
    alphas, losses = _arr(data["alphas"]), _arr(data["losses"])
    title = (f"loss landscape ({data.get('loss', '')}, filter-normalised directions, "
             f"span ±{data.get('span', '')}, {data.get('evals', '')} evals)")
    if data["dims"] == 1:
        fig = figure(6.5, 4.0)
        ax = fig.subplots()
        ax.plot(alphas, losses, marker=".", lw=1.4)
        ax.axvline(0.0, color="#777", lw=0.8, ls="--")
        ax.set_xlabel("α (direction 1)")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        fig.suptitle(title, fontsize=9)
        return save(fig, path)
    betas = _arr(data["betas"])
    fig = figure(11.0, 4.6)
    left, right = fig.subplots(1, 2, width_ratios=[1.25, 1])
    finite = losses[np.isfinite(losses)]
    z = np.where(np.isfinite(losses), losses, finite.max() if finite.size else 0.0)
    levels = np.unique(np.quantile(z, np.linspace(0, 1, 24))) if z.size > 1 else 10
    if isinstance(levels, np.ndarray) and len(levels) < 3:
        levels = 10
    filled = left.contourf(alphas, betas, z, levels=levels, cmap="viridis")
    left.contour(alphas, betas, z, levels=levels, colors="k", linewidths=0.3, alpha=0.5)
    left.plot([0], [0], marker="*", color="#cb181d", ms=10)
    left.set_xlabel("α (direction 1)")
    left.set_ylabel("β (direction 2)")
    fig.colorbar(filled, ax=left, label="loss")
    mid = len(betas) // 2
    right.plot(alphas, losses[mid], marker=".", lw=1.4, label="β = 0")
    right.plot(betas, losses[:, len(alphas) // 2], marker=".", lw=1.0, ls="--", label="α = 0")
    right.set_xlabel("distance along direction")
    right.set_ylabel("loss")
    right.legend(fontsize=8)
    right.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    return save(fig, path)


def save_landscape(result: Landscape, out_dir: str | Path, stem: str = "landscape") -> tuple[Path, Path]:
    """Write ``<stem>.json`` and ``<stem>.png`` into ``out_dir``; returns (png, json)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = result.to_dict()
    js = out_dir / f"{stem}.json"
    js.write_text(json.dumps(data, indent=1), encoding="utf-8")
    png = plot_landscape(data, out_dir / f"{stem}.png")
    return png, js


def sharpness(result: Landscape) -> float:
    """Largest rise of the loss over the grid above the centre (nan when nothing is finite)."""
    vals = _arr(result.losses).reshape(-1)
    vals = vals[np.isfinite(vals)]
    return float(vals.max() - result.center_loss) if vals.size and math.isfinite(result.center_loss) else math.nan

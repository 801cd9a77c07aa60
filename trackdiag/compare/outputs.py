"""A comparison written out: ``comparison.{csv,json,html}`` and the plot PNGs, each file atomically."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from trackdiag.compare.comparison import Comparison
from trackdiag.compare.html import render_html
from trackdiag.compare.table import to_csv, to_json

log = logging.getLogger("trackdiag")


def write_outputs(comparison: Comparison, out_dir: str | Path, *, plots: bool = True,
                  save_pngs: bool = True) -> dict[str, Path]:
    """Write ``comparison.{csv,json,html}`` (and plot PNGs) into ``out_dir``; returns name -> path.

    Plots need matplotlib (imported here, lazily); without it the HTML carries no images and a
    warning is logged. Files are written atomically (tmp + rename): readers never see half a file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, bytes] = {}
    if plots:
        try:
            from trackdiag.compare.plots import render_plots

            images = render_plots(comparison)
        except ImportError as e:
            log.warning("trackdiag compare: no plots (%s); pip install matplotlib", e)
    written = {
        "csv": _atomic_write(out / "comparison.csv", to_csv(comparison).encode()),
        "json": _atomic_write(out / "comparison.json", to_json(comparison).encode()),
        "html": _atomic_write(out / "comparison.html", render_html(comparison, images).encode()),
    }
    if save_pngs:
        for name, png in images.items():
            written[name] = _atomic_write(out / f"{name}.png", png)
    return written


def _atomic_write(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return path

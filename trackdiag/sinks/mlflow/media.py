"""Files the MLflow sink uploads: binned histograms (JSON per step) and their rendered images.

MLflow has no histogram type. Per logging step that carries histograms we write one compact
``histograms/step_<step>.json`` (``{key: {"edges": [...], "counts": [...]}}``, original keys)
and, when matplotlib is installed, an ``image`` op per histogram key: the delivery worker renders
it and stores it as ``MlflowClient.log_image(key=..., step=...)`` does (:func:`stage_image`), so
images travel with the other files of a batch in one upload (the UI's image charts have a step
slider). Rendering costs ~25-50 ms per image, off the training and sink threads, hence a per-step cap.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any, Mapping

from trackdiag.core.record import Histogram

log = logging.getLogger("trackdiag")


def write_json(path: Path, obj: Any) -> Path:
    """``obj`` as indented JSON at ``path`` (parents created); non-JSON values as strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
    return path


def write_histograms(media: Path, step: int, hists: Mapping[str, Histogram]) -> Path:
    """One JSON file with every histogram of a step: ``<media>/histograms/step_<step>.json``."""
    data = {k: {"edges": [float(e) for e in h.edges], "counts": [float(c) for c in h.counts]} for k, h in hists.items()}
    path = media / "histograms" / f"step_{step:09d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"step": step, "histograms": data}, separators=(",", ":")), encoding="utf-8")
    return path


def histogram_ops(media: Path, step: int, ts: int, hists: Mapping[str, Histogram], images: int) -> list[dict[str, Any]]:
    """The ops for one record's histograms: the step's JSON file (written now) and an ``image`` op
    for each of the first ``images`` histograms (rendered later, by the delivery worker)."""
    ops: list[dict[str, Any]] = [{"op": "artifact", "path": str(write_histograms(media, step, hists)), "dir": "histograms"}]
    for k, h in list(hists.items())[:images]:
        ops.append({"op": "image", "title": k, "edges": [float(e) for e in h.edges],
                    "counts": [float(c) for c in h.counts], "step": step, "ts": ts})
    return ops


def file_op(path: Path, obj: Any, artifact_path: str | None) -> dict[str, Any]:
    """Write ``obj`` (text as is, else JSON) to ``path``; the ``artifact`` op that uploads it."""
    if isinstance(obj, str):
        path.write_text(obj, encoding="utf-8")
    else:
        write_json(path, obj)
    return {"op": "artifact", "path": str(path), "dir": artifact_path}


def artifact_dir(path: Path, run_dir: Path) -> str:
    """The artifact dir of a file the run made: its dir relative to the run dir, else ``files``."""
    try:
        rel = path.resolve().parent.relative_to(run_dir.resolve())
    except ValueError:
        return "files"
    return rel.as_posix() if str(rel) != "." else "files"


class HistogramRenderer:
    """Draws a histogram into an RGB array with matplotlib's Agg canvas (no pyplot, no global
    state), for ``MlflowClient.log_image``. Runs in the delivery worker (or ``trackdiag sync``).

    One figure, one axes and one step patch serve every image: each call only swaps the data,
    limits and texts, then draws (~25-50 ms an image on this project's 2-core VM; a new axes and
    ``tight_layout`` per image cost ~105 ms, most of a Ctrl-C'd run's wait for delivery when the
    worker had not caught up). ``available`` turns False when matplotlib or Pillow (which
    ``log_image`` needs) is missing; then only the JSON data is logged, with one info line.
    """

    TITLE_CHARS = 40  # what fits the 256 px width at 9 pt; longer keys keep their end (the layer's name)

    def __init__(self) -> None:
        self._parts: Any = None
        self.available = True

    def _build(self) -> Any:
        if self._parts is None:
            try:
                import PIL  # noqa: F401  (log_image converts arrays with it)
                from matplotlib.backends.backend_agg import FigureCanvasAgg
                from matplotlib.figure import Figure
                from matplotlib.ticker import MaxNLocator
            except ImportError:
                self.available = False
                log.info("trackdiag: matplotlib not installed; MLflow gets histogram data (JSON) without images "
                         "(pip install 'trackdiag[plots]')")
                return None
            # 256 x 256 px: MLflow's image cards show the compressed copy, at most 256 px a side
            fig = Figure(figsize=(3.2, 3.2), dpi=80)
            FigureCanvasAgg(fig)
            ax = fig.add_axes((0.2, 0.15, 0.75, 0.64))  # room for the title, the offset texts and the tick labels
            patch = ax.stairs([0.0], [0.0, 1.0], fill=True, alpha=0.75)
            title = ax.set_title("", fontsize=9, pad=12)
            ax.set_ylabel("count", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.xaxis.set_major_locator(MaxNLocator(5))
            ax.ticklabel_format(axis="both", style="sci", scilimits=(-2, 3))
            warn = ax.text(0.5, 0.9, "", transform=ax.transAxes, ha="center", va="top", fontsize=7, color="#cb181d")
            self._parts = fig, ax, patch, title, warn
        return self._parts

    def to_array(self, title: str, edges: list[float], counts: list[float], step: int) -> Any:
        """An ``(H, W, 3)`` uint8 image of the histogram, or None (unavailable, bad data)."""
        parts = self._build() if self.available else None
        if parts is None or len(edges) != len(counts) + 1 or not counts:
            return None
        fig, ax, patch, text, warn = parts
        try:
            import numpy as np

            patch.set_data(counts, edges)
            lo, hi = float(edges[0]), float(edges[-1])
            pad = 0.02 * (hi - lo) if hi > lo else 0.5
            ax.set_xlim(lo - pad, hi + pad)
            ax.set_ylim(0.0, 1.05 * max(max(counts), 1.0))
            short = title.removeprefix("diag/")
            if len(short) > self.TITLE_CHARS:
                short = "…" + short[-(self.TITLE_CHARS - 1):]
            text.set_text(f"{short}\nstep {step}")
            total, ends = sum(counts), counts[0] + counts[-1]
            clamped = total > 0 and ends > 0.25 * total  # clamped values (out of range, NaN/Inf) pile up at the ends
            warn.set_text(f"{ends / total:.0%} in the end bins\n(out of range or NaN/Inf)" if clamped else "")
            fig.canvas.draw()
            return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
        except Exception as exc:  # inf edges and the like must not stop delivery
            log.debug("trackdiag: histogram %s at step %d not rendered: %s", title, step, exc)
            return None


def stage_image(renderer: HistogramRenderer, staging: Path, key: str, title: str, edges: list[float],
                counts: list[float], step: int, ts: int) -> list[Path]:
    """Render a histogram into ``staging/images/`` under the names MLflow 3.17's
    ``log_image(key=key, step=step, timestamp=ts)`` gives it (``<key, / as ~>+step+<step>+timestamp+
    <ts>+<uuid>.png`` and a ``+compressed.webp`` thumbnail: what the run page's image charts read),
    with a uuid derived from (key, step, ts) so that a batch delivered twice overwrites its images.
    Returns the files written ([] if it cannot be drawn). Costs ~30-60 ms (matplotlib + PIL)."""
    image = renderer.to_array(title, edges, counts, step)
    if image is None:
        return []
    if not re.match(r"^[a-zA-Z0-9_\-./ ]+$", key):
        raise ValueError(f"image key {key!r} has characters MLflow does not accept")
    from mlflow.tracking.multimedia import compress_image_size, convert_to_pil_image

    pil = convert_to_pil_image(image)
    name = f"{key.replace('/', '~')}+step+{step}+timestamp+{ts}+{uuid.uuid5(uuid.NAMESPACE_URL, f'{key}|{step}|{ts}')}"
    folder = staging / "images"
    folder.mkdir(parents=True, exist_ok=True)
    full, small = folder / f"{name}.png", folder / f"{name}+compressed.webp"
    pil.save(full)
    compress_image_size(pil).save(small)
    return [full, small]


def to_yaml(obj: Any) -> str:
    """``obj`` as YAML (JSON when it holds something YAML cannot represent)."""
    import yaml

    try:
        return yaml.safe_dump(obj, sort_keys=False)
    except yaml.YAMLError:
        return json.dumps(obj, indent=2, default=str)

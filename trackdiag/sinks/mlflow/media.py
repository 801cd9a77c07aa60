"""Files the MLflow sink uploads: binned histograms (JSON per step) and their rendered images.

MLflow has no histogram type. Per logging step that carries histograms we write one compact
``histograms/step_<step>.json`` (``{key: {"edges": [...], "counts": [...]}}``, original keys)
and an ``image`` op per histogram key: the delivery worker renders it
(:mod:`trackdiag.sinks.mlflow.hist_image`, ~1-2 ms an image) and stores it as ``MlflowClient.log_image(key=...,
step=...)`` does (:func:`stage_image`), so images travel with the other files of a batch in one upload (the UI's
image charts have a step slider); a per-step cap bounds their number.
"""
from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any, Mapping

from trackdiag.core.record import Histogram
from trackdiag.sinks.mlflow.hist_image import HistogramRenderer

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


def stage_image(renderer: HistogramRenderer, staging: Path, key: str, title: str, edges: list[float],
                counts: list[float], step: int, ts: int) -> list[Path]:
    """Render a histogram into ``staging/images/`` under the names MLflow 3.17's
    ``log_image(key=key, step=step, timestamp=ts)`` gives it (``<key, / as ~>+step+<step>+timestamp+
    <ts>+<uuid>.png`` and a ``+compressed.webp`` thumbnail: what the run page's image charts read),
    with a uuid derived from (key, step, ts) so that a batch delivered twice overwrites its images.
    Returns the files written ([] if it cannot be drawn)."""
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

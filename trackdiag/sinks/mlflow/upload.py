"""The data half of a group of ops: merged ``log_batch`` calls and one upload of every file.

:class:`Collected` gathers a group's points (as MLflow ``Metric`` entities, keys mapped), params,
tags (the last value of a key wins), files and histogram images (with the ``mlflow.loggedImages`` tag
that ``log_image`` sets and the run page's image charts need). :func:`send_batches` sends them
in as few ``log_batch`` calls as the limits allow (``_mlflow_batch.pack``). :func:`upload` stages
the files, rendered images and ``trackdiag/key_map.json`` in one temp tree and sends it with one
``log_artifacts`` call to a local artifact store, or file by file on 8 threads to a server (its
artifact API takes one file per request). Runs in the delivery worker (or ``trackdiag sync``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trackdiag.core.record import Record
from trackdiag.sinks.mlflow.batch import pack
from trackdiag.util.pool import thread_map

if TYPE_CHECKING:
    from trackdiag.sinks.mlflow.ops import KeyMap



class Uploader(Protocol):
    """What :func:`upload` uses of a :class:`~trackdiag.sinks.mlflow.run.Runner` (which imports this module)."""

    state: dict[str, Any]
    keys: KeyMap
    renderer: Any
    client: Any


UPLOAD_THREADS = 8
#: the run tag ``MlflowClient.log_image`` sets: the run page lists image charts only for runs carrying it
LOGGED_IMAGES = "mlflow.loggedImages"


class Collected:
    """A group's data, merged (see the module doc). ``add`` raises ValueError for an unknown op."""

    def __init__(self) -> None:
        self.metrics: list[Any] = []
        self.params: dict[str, str] = {}
        self.tags: dict[str, str] = {}
        self.files: list[tuple[Path, str | None]] = []
        self.images: list[dict[str, Any]] = []
        self.key_map = False

    def add(self, op: dict[str, Any], keys: KeyMap) -> str | None:
        """Take one op; returns why it is skipped (its file is gone), else None."""
        kind = op["op"]
        if kind == "points":
            from mlflow.entities import Metric

            for step, ts, scalars, series in op["records"]:
                rec = Record(step=int(step), scalars=scalars, series=series)
                self.metrics += [Metric(keys(k), float(v), int(ts), int(s)) for k, s, v in rec.points()]
        elif kind == "params":
            for k, v in op["items"]:
                self.params.setdefault(str(k), str(v))  # one value per key in a batch (MLflow's rule)
        elif kind == "tags":
            self.tags.update((str(k), str(v)) for k, v in op["items"])
        elif kind == "artifact":
            if not Path(op["path"]).exists():
                return f"artifact {op['path']} no longer exists"
            self.files.append((Path(op["path"]), op.get("dir")))
        elif kind == "image":
            self.images.append(op)
            self.tags[LOGGED_IMAGES] = "True"  # as log_image(key=..., step=...) does; sent with the group's log_batch
        elif kind == "key_map":
            self.key_map = True
        else:
            raise ValueError(f"unknown MLflow op {kind!r}")
        return None


def _size(entity: Any) -> int:
    """Estimated JSON bytes of a Metric / Param / RunTag in a ``log_batch`` request."""
    return len(entity.key) + (80 if hasattr(entity, "step") else len(str(entity.value)) + 40)


def send_batches(client: Any, run_id: str, got: Collected, known_params: set[str]) -> int:
    """``log_batch`` the group's metrics, new params and tags; returns the number of calls.
    ``known_params`` (params already on the run) is skipped and updated after each call."""
    from mlflow.entities import Param, RunTag

    params = [Param(k, v) for k, v in got.params.items() if k not in known_params]
    tags = [RunTag(k, v) for k, v in got.tags.items()]
    calls = 0
    for metrics, ps, ts in pack(got.metrics, params, tags, _size):
        client.log_batch(run_id, metrics=metrics, params=ps, tags=ts, synchronous=True)
        known_params.update(p.key for p in ps)
        calls += 1
    return calls


def _stage(path: Path, target_dir: Path) -> None:
    """Put ``path`` (a file, or a dir's contents) under ``target_dir``: hard links where possible."""
    if path.is_dir():
        shutil.copytree(path, target_dir, dirs_exist_ok=True)
        return
    if not path.is_file():
        raise FileNotFoundError(f"artifact {path} no longer exists")
    target_dir.mkdir(parents=True, exist_ok=True)
    dest = target_dir / path.name
    dest.unlink(missing_ok=True)
    try:
        os.link(path, dest)
    except OSError:
        shutil.copyfile(path, dest)


def upload(runner: Uploader, got: Collected) -> int:
    """Upload the group's files, images and key map; returns the number of MLflow calls."""
    if not got.files and not got.images and not (got.key_map and runner.keys.changed):
        return 0
    run_id = runner.state["run_id"]
    with tempfile.TemporaryDirectory(prefix="trackdiag-mlflow-") as tmp:
        staging = Path(tmp)
        for path, artifact_dir in got.files:
            _stage(path, staging / (artifact_dir or ""))
        if got.images:
            from trackdiag.sinks.mlflow.media import HistogramRenderer, stage_image

            runner.renderer = runner.renderer or HistogramRenderer()
            for op in got.images:
                stage_image(runner.renderer, staging, runner.keys(op["title"]), op["title"], op["edges"],
                            op["counts"], int(op["step"]), int(op["ts"]))
        if got.key_map and runner.keys.changed:  # only keys MLflow would have rejected or that collided
            (staging / "trackdiag").mkdir(exist_ok=True)
            (staging / "trackdiag" / "key_map.json").write_text(json.dumps(runner.keys.changed, indent=2),
                                                                encoding="utf-8")
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        if not files:
            return 0
        if not runner.state["tracking_uri"].startswith(("http://", "https://")):
            runner.client.log_artifacts(run_id, str(staging))  # a local artifact store: one copy of the tree
            return 1

        def put(f: Path) -> None:
            rel = f.parent.relative_to(staging).as_posix()
            runner.client.log_artifact(run_id, str(f), None if rel == "." else rel)

        put(files[0])  # first alone: MLflow caches the run's artifact repository (one get_run, not one per thread)
        if len(files) > 1:
            list(thread_map(put, files[1:], UPLOAD_THREADS, "trackdiag-upload"))  # re-raises the first failure
        return len(files)

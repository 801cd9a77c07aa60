"""Executes MLflow sink ops (see ``_mlflow_ops``) with an ``MlflowClient``, on one thread.

The run state (tracking URI, run id, whether we own the run, sweep parent) lives in a plain dict
so the spool can persist it and ``trackdiag sync`` can resume delivery in another process.
Every call here is network or database I/O: this runs on the sink's delivery thread or in the
``trackdiag sync`` command, never on the training thread.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from trackdiag.record import Record
from trackdiag.sinks._mlflow_ops import KeyMap, chunk_metrics, sanitize_key

log = logging.getLogger("trackdiag")

ROLE_TAG = "trackdiag.role"      # "sweep" on a Hydra multirun's parent run
SWEEP_TAG = "trackdiag.sweep"    # the sweep dir, on the parent and on every job's run
PARENT_TAG = "mlflow.parentRunId"


class NoRun(RuntimeError):
    """An op needs the run, but the run could not be set up (see the earlier warning)."""


class Runner:
    """Applies ops to one run. ``state`` keys: ``tracking_uri``, ``run_id``, ``owns_run``,
    ``parent_run_id``, ``experiment_id``; ``open`` fills them in."""

    def __init__(self, state: dict[str, Any]) -> None:
        from mlflow import MlflowClient  # lazy: importing mlflow costs ~2 s

        self.state = state
        self.client = MlflowClient(tracking_uri=state["tracking_uri"])
        self._known_params: set[str] | None = None
        self.keys = KeyMap()  # metric/image keys -> MLflow keys (see _mlflow_ops.sanitize_key)
        self._renderer: Any = None

    def run(self, op: dict[str, Any]) -> None:
        """Execute one op; raises whatever MLflow raises (the caller classifies it)."""
        kind = op["op"]
        if kind != "open" and not self.state.get("run_id"):
            raise NoRun("the MLflow run was never created")
        getattr(self, f"_{kind}")(op)

    # ------------------------------------------------------------------ run set-up
    def _open(self, op: dict[str, Any]) -> None:
        spec = op["spec"]
        if self.state.get("run_id"):  # replayed by sync after the run was made
            return
        if spec.get("attach_run_id"):
            run = self.client.get_run(spec["attach_run_id"])
            self.state.update(run_id=run.info.run_id, owns_run=False, parent_run_id=None,
                              experiment_id=run.info.experiment_id)
            return
        location = spec.get("artifact_location") or default_artifact_location(
            self.state["tracking_uri"], Path.cwd(), spec["experiment"])  # sync may target another store
        eid = self._experiment(spec["experiment"], location)
        tags: dict[str, Any] = {}
        parent = self._parent(eid, spec["group"]) if spec.get("group") else None
        if parent:
            tags[PARENT_TAG] = parent
        try:
            from mlflow.tracking.context.registry import resolve_tags

            tags = resolve_tags(tags)  # user, source name, git commit, like mlflow.start_run
        except Exception:  # context providers are best effort
            pass
        run = self.client.create_run(eid, start_time=spec.get("start_ms"), tags=tags, run_name=spec["run_name"])
        self.state.update(run_id=run.info.run_id, owns_run=True, parent_run_id=parent, experiment_id=eid)

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                return str(self.client.create_experiment(name, artifact_location=artifact_location))
            except Exception:
                exp = self.client.get_experiment_by_name(name)  # a sibling job created it first
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise ValueError(f"MLflow experiment {name!r} is deleted: restore it (mlflow experiments restore) "
                             f"or set diag.sink.mlflow.experiment")
        return str(exp.experiment_id)

    def _parent(self, eid: str, group: str) -> str:
        """The sweep's parent run: found by its tags, else created, under a file lock in the sweep
        dir so that jobs of one sweep never create two parents."""
        with _sweep_lock(Path(group)):
            found = self.client.search_runs([eid], filter_string=f"tags.`{ROLE_TAG}` = 'sweep'",
                                            order_by=["attributes.start_time ASC"], max_results=1000)
            for run in found:
                if run.data.tags.get(SWEEP_TAG) == group:
                    if run.info.status not in ("RUNNING", "FAILED", "KILLED"):
                        self.client.update_run(run.info.run_id, status="RUNNING")
                    return str(run.info.run_id)
            name = f"sweep {Path(group).parent.name}/{Path(group).name}".strip()
            run = self.client.create_run(eid, tags={ROLE_TAG: "sweep", SWEEP_TAG: group}, run_name=name)
            return str(run.info.run_id)

    # ------------------------------------------------------------------ data
    def _points(self, op: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        keys, metrics = self.keys, []
        for step, ts, scalars, series in op["records"]:
            rec = Record(step=int(step), scalars=scalars, series=series)
            metrics += [Metric(keys(k), float(v), int(ts), int(s)) for k, s, v in rec.points()]
        for chunk in chunk_metrics(metrics, lambda m: len(m.key)):
            self.client.log_batch(self.state["run_id"], metrics=chunk, synchronous=True)

    def _key_map(self, op: dict[str, Any]) -> None:
        if self.keys.changed:  # only keys that MLflow would have rejected or that collided
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "key_map.json"
                path.write_text(json.dumps(self.keys.changed, indent=2), encoding="utf-8")
                self.client.log_artifact(self.state["run_id"], str(path), artifact_path="trackdiag")

    def _params(self, op: dict[str, Any]) -> None:
        from mlflow.entities import Param

        if self._known_params is None:  # params already on the run (the user's own, or an earlier try)
            self._known_params = set(self.client.get_run(self.state["run_id"]).data.params)
        items = [(k, v) for k, v in op["items"] if k not in self._known_params]
        if items:
            self.client.log_batch(self.state["run_id"], params=[Param(k, v) for k, v in items], synchronous=True)
            self._known_params.update(k for k, _ in items)

    def _tags(self, op: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(k, v) for k, v in op["items"]]
        self.client.log_batch(self.state["run_id"], tags=tags, synchronous=True)

    def _artifact(self, op: dict[str, Any]) -> None:
        path = Path(op["path"])
        if path.is_dir():
            self.client.log_artifacts(self.state["run_id"], str(path), artifact_path=op.get("dir"))
        elif path.is_file():
            self.client.log_artifact(self.state["run_id"], str(path), artifact_path=op.get("dir"))
        else:
            raise FileNotFoundError(f"artifact {path} no longer exists")

    def _image(self, op: dict[str, Any]) -> None:
        if self._renderer is None:
            from trackdiag.sinks._mlflow_media import HistogramRenderer

            self._renderer = HistogramRenderer()
        image = self._renderer.to_array(op["title"], op["edges"], op["counts"], int(op["step"]))
        if image is not None:  # None: matplotlib missing or unplottable data; the JSON has it all
            self.client.log_image(self.state["run_id"], image, key=self.keys(op["title"]), step=int(op["step"]),
                                  timestamp=int(op["ts"]), synchronous=True)

    def _end(self, op: dict[str, Any]) -> None:
        status, ts = op["status"], int(op.get("ts") or time.time() * 1000)
        if not self.state.get("owns_run"):
            return  # the user's run: they end it
        self.client.set_terminated(self.state["run_id"], status, end_time=ts)
        parent = self.state.get("parent_run_id")
        if parent:  # the sweep's status: FINISHED unless a job failed or was killed (sticky)
            current = self.client.get_run(parent).info.status
            new = status if status != "FINISHED" else (current if current in ("FAILED", "KILLED") else "FINISHED")
            self.client.set_terminated(parent, new, end_time=ts)


@contextlib.contextmanager
def _sweep_lock(group: Path) -> Iterator[None]:
    """An exclusive lock shared by the jobs of one sweep (POSIX ``flock``; no-op elsewhere)."""
    try:
        import fcntl

        group.mkdir(parents=True, exist_ok=True)
        f = open(group / ".trackdiag_mlflow.lock", "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def default_tracking_uri(cwd: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<cwd>/mlflow.db`` (never MLflow's cwd-relative
    guess); a relative SQLite path is made absolute against ``cwd`` (Hydra may chdir into the job dir)."""
    return absolute_sqlite(os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db", cwd)


def absolute_sqlite(uri: str, cwd: Path) -> str:
    """``sqlite:///rel.db`` -> ``sqlite:////<cwd>/rel.db``; any other URI unchanged."""
    path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if not path or path.startswith("/") or path == ":memory:" or Path(path).is_absolute():
        return uri
    return f"sqlite:///{(Path(cwd) / path).resolve()}"


def default_artifact_location(tracking_uri: str, cwd: Path, experiment: str) -> str | None:
    """``<db dir>/mlartifacts/<experiment>`` for SQLite stores (``<cwd>/mlartifacts/...`` for other
    databases), so MLflow never falls back to ``./mlruns``; None for servers and file stores."""
    if tracking_uri.startswith(("http:", "https:", "databricks", "file:", "/")) or "://" not in tracking_uri:
        return None
    base = Path(cwd)
    if tracking_uri.startswith("sqlite:///") and tracking_uri != "sqlite:///:memory:":
        base = Path(tracking_uri[len("sqlite:///"):]).parent
    return (base.resolve() / "mlartifacts" / sanitize_key(experiment).replace("/", "_")).as_uri()


def health_url(tracking_uri: str) -> str | None:
    """``<server>/health`` for an http(s) tracking URI, else None (local stores need no probe)."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/") + "/health"
    return None


def healthy(url: str | None, timeout: float = 2.0) -> bool:
    """One GET without retries: is the tracking server answering? True for local stores."""
    if url is None:
        return True
    try:
        import requests

        return requests.get(url, timeout=timeout).status_code == 200
    except Exception:
        return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (for spool ownership checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True

"""The MLflow half of a sweep's start and end, for the Hydra callback.

At the start (launcher process, :func:`create_parent`): the sweep's parent run, before any job
exists, so parallel jobs only find it. At the end (:func:`end_sweep`, whichever process saw the
last job end): spools the jobs left under the sweep dir delivered, duplicate parents merged, the
runs of killed jobs completed from their local records and ended KILLED, the comparison logged to
the parent, and the parent ended with the sweep's status. Every call here is network or database
I/O against the store the jobs used; none runs on a training thread.
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trackdiag.util.pool import thread_map

log = logging.getLogger("trackdiag.compare")

THREADS = 8


def target(config: DictConfig) -> tuple[str, str] | None:
    """(tracking URI, experiment name) the jobs' MLflow sink uses, or None when it is not in use."""
    sinks = OmegaConf.select(config, "diag.sinks", default=None) or []
    if "mlflow" not in list(sinks) and OmegaConf.select(config, "diag.sink.mlflow", default=None) is None:
        return None

    name = OmegaConf.select(config, "diag.sink.mlflow.experiment", default=None) \
        or OmegaConf.select(config, "hydra.job.name", default=None) or "trackdiag"
    return mlflow_store(config), str(name)


def _client(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    from trackdiag.sinks.mlflow.new_store import seed

    seed(uri)  # the sweep's parent run may be the first thing in a new SQLite store
    return MlflowClient(tracking_uri=uri)


def create_parent(config: DictConfig, sweep: Path) -> str | None:
    """The launcher's parent run for ``sweep`` (found or created; experiment created if needed), or
    None when MLflow is not used or the store does not answer (the jobs then create it under the
    sweep dir's lock). ~4 calls, plus ~2 s to import MLflow."""
    where = target(config)
    if where is None:
        return None
    uri, name = where
    from trackdiag.sinks.mlflow.store import default_artifact_location, health_url, healthy

    if not healthy(health_url(uri), timeout=5.0):
        log.warning("trackdiag: MLflow at %s does not answer; the sweep's jobs will create its parent run", uri)
        return None
    from trackdiag.sinks.mlflow.run import Runner, run_tags
    from trackdiag.sinks.mlflow.sweep import get_or_create_parent

    runner = Runner({"tracking_uri": uri, "run_id": None})
    cwd = Path(str(OmegaConf.select(config, "hydra.runtime.cwd", default=None) or Path.cwd()))
    eid = runner._experiment(name, default_artifact_location(uri, cwd, name))
    source = str((cwd / sys.argv[0]).resolve()) if sys.argv and sys.argv[0] not in ("", "-c", "-") else None
    parent, _ = get_or_create_parent(runner.client, eid, str(sweep), run_tags(source))
    log.info("trackdiag: sweep parent run %s in MLflow experiment %r at %s", parent, name, uri)
    return parent


def deliver_spools(sweep: Path, uri: str) -> None:
    """Deliver what the jobs left spooled under ``sweep`` for ``uri`` (a job whose close gave up while
    the server was away); spools a live process holds are skipped. Bounded by what is there."""
    from trackdiag.sinks.mlflow.leftovers import deliver

    for line in deliver(sweep, uri, set()):
        log.info("trackdiag: %s", line)


def complete_from_record(client: Any, run_id: str, run_dir: Path, fresh: bool = False) -> int:
    """Log every point of the local record ``run_dir`` that run ``run_id`` lacks (a killed job's last
    points never left its process). One history call per key (8 threads), then ``log_batch``
    calls of <= 1000 points (``fresh``: a run just made, no history to read). Returns the points added."""
    from mlflow.entities import Metric

    from trackdiag.core.record import read_records
    from trackdiag.sinks.mlflow.ops import KeyMap, chunk_metrics

    keys = KeyMap()
    local: dict[str, dict[int, tuple[float, int]]] = {}
    for rec in read_records(run_dir):
        ts = int((rec.time or 0) * 1000)
        for k, step, value in rec.points():
            local.setdefault(keys(k), {})[int(step)] = (float(value), ts)
    if not local:
        return 0

    def have(key: str) -> set[int]:
        return {m.step for m in client.get_metric_history(run_id, key)}

    if fresh:
        stored: dict[str, set[int]] = {k: set() for k in local}
    else:
        stored = dict(zip(local, thread_map(have, local, THREADS)))  # this may run at the launcher's exit
    missing = [Metric(k, v if not math.isinf(v) else math.copysign(1.7976931348623157e308, v), ts, s)
               for k, pts in local.items() for s, (v, ts) in sorted(pts.items()) if s not in stored[k]]
    for chunk in chunk_metrics(missing, lambda m: len(m.key)):
        client.log_batch(run_id, metrics=chunk, synchronous=True)
    return len(missing)


def record_dirs(sweep: Path, nums: list[int]) -> dict[int, Path]:
    """Job number -> local run dir (``run.json`` naming that job) under ``sweep``, for ``nums``."""
    out: dict[int, Path] = {}
    for meta in sweep.rglob("run.json"):
        if any(part.startswith(".") for part in meta.relative_to(sweep).parts) or not nums:
            continue
        try:
            num = json.loads(meta.read_text(encoding="utf-8")).get("job_num")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(num, int) and num in nums:
            out[num] = meta.parent
    return out


def create_from_record(client: Any, experiment_id: str, parent: str, sweep: Path, run_dir: Path) -> str:
    """A killed job that died before its run existed on the server (its delivery worker was still
    starting): the child run made from its local record, as the sink would have (name, trackdiag
    tags, params, every point), ended KILLED. Returns the run id. ~3 calls plus one per 1000 points."""
    from mlflow.entities import Param

    from trackdiag.core.version import __version__
    from trackdiag.sinks.mlflow.ops import flatten, user_params
    from trackdiag.sinks.mlflow.sweep import PARENT_TAG, STATUS_TAG, SWEEP_TAG

    meta = json.loads((run_dir / "run.json").read_text(encoding="utf-8"))
    level = str(meta.get("level") or "")
    tags = {"trackdiag.level": level, "trackdiag.version": __version__, "trackdiag.run_dir": str(run_dir),
            "trackdiag.run_name": str(meta.get("name")), "trackdiag.job_num": str(meta.get("job_num")),
            "trackdiag.components": ",".join(map(str, meta.get("components") or [])), SWEEP_TAG: str(sweep),
            PARENT_TAG: parent, STATUS_TAG: "KILLED", "trackdiag.health": "killed"}
    start = meta.get("start_time")
    run = client.create_run(experiment_id, run_name=str(meta.get("name")), tags=tags,
                            start_time=int(start * 1000) if isinstance(start, (int, float)) else None)
    params = [Param(k, v) for k, v in user_params(flatten(meta.get("hparams") or {}), level).items()]
    for i in range(0, len(params), 100):
        client.log_batch(run.info.run_id, params=params[i:i + 100], synchronous=True)
    complete_from_record(client, run.info.run_id, run_dir, fresh=True)
    client.set_terminated(run.info.run_id, "KILLED")
    return str(run.info.run_id)


def settle(uri: str, experiment: str, sweep: Path, dead: list[int]) -> tuple[Any, str, dict[str, str]] | None:
    """Make every run of the sweep final before it is compared: spools delivered, duplicate parents
    merged, the runs of killed jobs (``dead``) completed from their local records and ended KILLED.
    Returns (client, parent run id, run id -> status of every child), or None (one warning) if the
    sweep has no parent run in the store."""
    from mlflow.entities import RunTag

    from trackdiag.sinks.mlflow.sweep import STATUS_TAG, children, merge_parents

    deliver_spools(sweep, uri)
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    eids = [exp.experiment_id] if exp is not None else [e.experiment_id for e in client.search_experiments()]
    parent = merge_parents(client, eids, str(sweep)) if eids else None
    if parent is None:
        log.warning("trackdiag: sweep comparison not logged to MLflow: no parent run for sweep %s in %s (the jobs' "
                    "MLflow data may still be spooled: `trackdiag sync <job dir>` delivers it)", sweep, uri)
        return None
    runs = children(client, eids, parent)
    statuses = {r.info.run_id: r.info.status for r in runs}
    for run in runs:
        num = run.data.tags.get("trackdiag.job_num", "")
        if not num.isdigit() or int(num) not in dead:
            continue
        run_dir = Path(run.data.tags.get("trackdiag.run_dir", ""))
        added = complete_from_record(client, run.info.run_id, run_dir) if (run_dir / "run.json").exists() else 0
        if run.info.status == "RUNNING":  # else its orphaned delivery worker ended it KILLED already
            client.log_batch(run.info.run_id, tags=[RunTag(STATUS_TAG, "KILLED"), RunTag("trackdiag.health", "killed")],
                             synchronous=True)
            client.set_terminated(run.info.run_id, "KILLED")
            statuses[run.info.run_id] = "KILLED"
        log.warning("trackdiag: job %s of the sweep died before it ended: MLflow run %s is %s, %d point(s) added "
                    "from its local record", num, run.info.run_id, statuses[run.info.run_id], added)
    seen = {int(n) for r in runs if (n := r.data.tags.get("trackdiag.job_num", "")).isdigit()}
    unseen = [n for n in dead if n not in seen]
    if unseen:
        eid = client.get_run(parent).info.experiment_id
        for num, run_dir in sorted(record_dirs(sweep, unseen).items()):
            run_id = create_from_record(client, eid, parent, sweep, run_dir)
            statuses[run_id] = "KILLED"
            log.warning("trackdiag: job %d of the sweep died before its MLflow run existed: run %s made from its "
                        "local record, KILLED", num, run_id)
    return client, parent, statuses


def publish(client: Any, parent: str, statuses: dict[str, str], files: list[Path],
            stops: dict[str, Any] | None = None) -> str:
    """End the parent run with the sweep's status (the jobs' statuses: FAILED > KILLED > FINISHED), also as
    tag ``trackdiag.status``, then log ``files`` to it under ``trackdiag/``. Returns the status.
    ``stops`` (an Optuna sweep's :func:`~trackdiag.compare.trials.stop_totals`): logged as tags
    ``trackdiag.trials_stopped``/``steps_saved``/``seconds_saved`` and metrics ``trackdiag/trials``,
    ``trackdiag/trials_stopped``, ``trackdiag/steps_saved``, ``trackdiag/seconds_saved`` (one batch)."""
    from trackdiag.sinks.mlflow.sweep import STATUS_TAG, sweep_status

    if stops:
        from mlflow.entities import Metric, RunTag

        now = int(time.time() * 1000)
        client.log_batch(parent, metrics=[Metric(f"trackdiag/{k}", float(stops[k]), now, 0) for k in
                                          ("trials", "stopped", "steps_saved", "seconds_saved")],
                         tags=[RunTag("trackdiag.trials_stopped", str(stops["stopped"])),
                               RunTag("trackdiag.steps_saved", str(stops["steps_saved"])),
                               RunTag("trackdiag.seconds_saved", str(stops["seconds_saved"]))], synchronous=True)
    status = sweep_status(list(statuses.values()))
    client.set_tag(parent, STATUS_TAG, status)  # the status first: a file that fails to upload must not leave it RUNNING
    if status != "RUNNING":
        client.set_terminated(parent, status)
    for f in files:
        client.log_artifact(parent, str(f), artifact_path="trackdiag")
    log.info("trackdiag: comparison logged to MLflow parent run %s (%d jobs, sweep %s)", parent, len(statuses), status)
    return status


def mlflow_store(config: DictConfig) -> str:
    """The tracking URI the MLflow sink of this app's jobs used: ``diag.sink.mlflow.tracking_uri``,
    else ``$MLFLOW_TRACKING_URI``, else the default ``sqlite:///<original cwd>/mlflow.db``."""
    from trackdiag.sinks.mlflow.store import absolute_sqlite, default_tracking_uri

    cwd = Path(str(OmegaConf.select(config, "hydra.runtime.cwd", default=None) or os.getcwd()))
    uri = OmegaConf.select(config, "diag.sink.mlflow.tracking_uri", default=None)
    return absolute_sqlite(str(uri), cwd) if uri else default_tracking_uri(cwd)

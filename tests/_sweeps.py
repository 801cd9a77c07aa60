"""Helpers for the sweep tests: the user's app outside the repo, the sweep command, server checks."""
from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import _warm as warm
from _postgres import PgMlflowServer, Postgres
from _procs import AFTER_GROUP

REPO = Path(__file__).resolve().parents[1]


def start_server(root: Path) -> PgMlflowServer:
    """A fresh PostgreSQL and an MLflow server on it (``srv.pg`` is the PostgreSQL); call :func:`stop_server`."""
    pg = Postgres()
    pg.start()
    srv = PgMlflowServer(root, pg.create_db("mlflow"))
    srv.pg = pg  # type: ignore[attr-defined]
    srv.start()
    srv.wait(240)
    return srv


def stop_server(srv: PgMlflowServer | None) -> None:
    if srv is not None:
        srv.stop()
        srv.pg.stop()  # type: ignore[attr-defined]


_SHARED: list[PgMlflowServer] = []


def _alive_and_healthy(srv: PgMlflowServer, grace: float = 60.0) -> bool:
    """Whether ``srv`` answers ``/health``; a server process still running gets ``grace`` seconds (one busy
    with the last sweep's requests can miss a 2 s health check, and a restart costs 30-50 s)."""
    if srv.proc is None or srv.proc.poll() is not None:
        return False
    try:
        srv.wait(grace)
        return True
    except (TimeoutError, RuntimeError):
        return False


def server_fixture(tmp_path_factory: Any) -> Iterator[PgMlflowServer]:
    """The test process's one PostgreSQL + MLflow server (started on first use, ~30-50 s on 2 busy
    cores; stopped at exit): every sweep test logs to its own experiment. A test that stopped it
    must leave it running again."""
    if not _SHARED:
        srv = start_server(tmp_path_factory.getbasetemp() / "mlflow_server")
        _SHARED.append(srv)
        atexit.register(stop_server, srv)
        AFTER_GROUP.setdefault("sweeps", []).append(_release)  # stopped with the sweeps group's last test
    elif not _alive_and_healthy(_SHARED[0]):
        _SHARED[0].stop()
        _SHARED[0].start()
        _SHARED[0].wait(240)
    yield _SHARED[0]


def _release() -> None:
    """Stop the shared server and its PostgreSQL (a later sweep test would start them again)."""
    if _SHARED:
        stop_server(_SHARED.pop())


def copy_app(dest: Path) -> Path:
    """A copy of the example app in ``dest``: the user's own project, not ours."""
    shutil.copy(REPO / "examples" / "train.py", dest / "train.py")
    shutil.copytree(REPO / "examples" / "conf", dest / "conf")
    return dest


def sweep_cmd(sweep: Path, uri: str, experiment: str, *overrides: str) -> tuple[list[str], dict[str, str]]:
    """The multirun command line and environment: ``MLFLOW_TRACKING_URI`` names the team's server."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["MLFLOW_TRACKING_URI"] = uri
    # one intra-op thread per job, as on a cluster (cpus_per_task): parallel CPU jobs each with the
    # default 2 OpenMP threads spin against each other on 2 cores (500 ms steps instead of 2 ms under
    # submitit_local; loky already limits joblib's workers this way)
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "train.py", "-m", *overrides, f"diag.sink.mlflow.experiment={experiment}",
           f"hydra.sweep.dir={sweep}"]
    return cmd, env


def run_sweep(app: Path, sweep: Path, uri: str, experiment: str, *overrides: str) -> subprocess.CompletedProcess:
    cmd, env = sweep_cmd(sweep, uri, experiment, *overrides)
    return warm.run(cmd, cwd=app, env=env, capture_output=True, text=True, timeout=1200)


def sweep_runs(client: Any, experiment: str, sweep: Path) -> tuple[Any, list[Any]]:
    """(the one parent run of ``sweep``, its children); fails if there is not exactly one parent."""
    exp = client.get_experiment_by_name(experiment)
    parents = client.search_runs([exp.experiment_id], "tags.`trackdiag.role` = 'sweep'")
    assert [p.data.tags["trackdiag.sweep"] for p in parents] == [str(sweep)], parents
    kids = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'",
                              max_results=1000)
    return parents[0], kids


def missing_points(client: Any, kids: list[Any]) -> dict[str, int]:
    """Run name -> local-record points absent from (or different on) the server, every key of every job."""
    from _mlflow_util import history, local_points, same_points

    from trackdiag.sinks.mlflow.ops import sanitize_key

    def check(run: Any) -> tuple[str, int]:
        local = local_points(Path(run.data.tags["trackdiag.run_dir"]))
        assert local, run.info.run_name
        bad = sum(len(pts) for k, pts in local.items()
                  if not same_points(history(client, run.info.run_id, sanitize_key(k)), pts))
        return run.info.run_name, bad

    with ThreadPoolExecutor(8) as pool:
        return {name: bad for name, bad in pool.map(check, kids) if bad}


def job_overrides(sweep: Path, num: int) -> list[str]:
    return list(json.loads((sweep / ".trackdiag" / "jobs" / f"{num}.json").read_text()).get("overrides") or [])


def wait_for(cond: Callable[[], Any], timeout: float, what: str, poll: float = 0.3) -> Any:
    t0 = time.monotonic()
    while not (got := cond()):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not after {timeout:.0f}s")
        time.sleep(poll)
    return got


def record_lines(sweep: Path, num: int) -> int:
    """Records job ``num`` has written to its local record so far."""
    try:
        return (sweep / str(num) / "diag" / "records.jsonl").read_bytes().count(b"\n")
    except OSError:
        return 0


def finalized(sweep: Path) -> dict[str, Any] | None:
    try:
        return json.loads((sweep / ".trackdiag" / "finalized.json").read_text())
    except (OSError, ValueError):
        return None

"""Faults of a shared server during a parallel sweep: the server restarts mid-sweep; a job is killed.

Real PostgreSQL, a real ``mlflow server --serve-artifacts`` on it, Hydra's real launchers, the
example app run as the user's own app. Nothing may be lost and every status must be the truth.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Iterator

import pytest

import _warm as warm
from _postgres import PgMlflowServer, skip_reason
from _sweeps import (copy_app, finalized, missing_points, record_lines, server_fixture, sweep_cmd, sweep_runs,
                     wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PgMlflowServer]:
    yield from server_fixture(tmp_path_factory)


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    return copy_app(tmp_path / "app")


def outage_seen(sweep: Path) -> bool:
    """A job's Hydra log (``<job>/train.log``) holds the sink's one warning per outage."""
    return any("unreachable" in log.read_text(errors="replace") for log in sweep.glob("*/*.log"))


def test_server_restarted_mid_sweep_loses_nothing(server: PgMlflowServer, app: Path, tmp_path: Path) -> None:
    """The server goes away while the first jobs train and comes back (same store, same port) while
    the sweep goes on: training never stops, every point of every job reaches the server, every run
    ends final and true. Three jobs on two loky workers: the third starts in a worker the first wave used
    (issue 47: a fourth checked nothing the third does not)."""
    sweep = tmp_path / "multirun" / "restart"
    cmd, env = sweep_cmd(sweep, server.uri, "restart", "+diag=basic", "hydra/launcher=joblib",
                         "hydra.launcher.n_jobs=2", "steps=1500", "eval_every=100", "seed=0,1,2")
    proc = warm.popen(cmd, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: dict[str, str] = {}
    reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate(timeout=1200))))
    reader.start()
    try:
        wait_for(lambda: record_lines(sweep, 0) >= 3 or record_lines(sweep, 1) >= 3, 300, "jobs training")
        server.stop()  # mid-request, mid-sweep
        down_at = [record_lines(sweep, n) for n in range(3)]
        try:  # down until a job has met the outage (a busy machine may take a while to try)
            wait_for(lambda: outage_seen(sweep), 240, "a job warning that MLflow is unreachable")
        finally:
            server.start()  # same PostgreSQL, same port; the sweep trains on while it boots
            server.wait(240)
    finally:
        reader.join(1300)
    assert proc.returncode == 0, out.get("stderr", "")[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(server.uri)
    parent, kids = sweep_runs(client, "restart", sweep)
    assert len(kids) == 3 and {r.info.status for r in kids} == {"FINISHED"}
    assert parent.info.status == "FINISHED"
    assert missing_points(client, kids) == {}
    assert all(json.loads((Path(r.data.tags["trackdiag.run_dir"]) / "summary.json").read_text())["steps"] == 1500
               for r in kids)  # training went on through the outage
    logs = out["stdout"] + out["stderr"]  # Hydra's job logging goes to stdout
    assert "unreachable" in logs, (down_at, logs[-3000:])  # the outage hit the sweep
    assert not list(sweep.rglob("mlflow_spool/seg-*.jsonl"))  # nothing left behind
    assert {f.path for f in client.list_artifacts(parent.info.run_id, "trackdiag")} >= {"trackdiag/comparison.json"}


def test_killed_job_is_killed_others_unaffected(server: PgMlflowServer, app: Path, tmp_path: Path) -> None:
    """``submitit_local``: job 1's process gets SIGKILL mid-run. Its MLflow run ends KILLED with every
    point its local record holds; jobs 0 and 2 finish untouched; the comparison, written once the
    last job ended (after the launcher itself gave up on job 1), marks job 1 KILLED."""
    sweep = tmp_path / "multirun" / "killed"
    cmd, env = sweep_cmd(sweep, server.uri, "killed", "+diag=basic", "hydra/launcher=submitit_local",
                         "hydra.launcher.timeout_min=20", "steps=2500", "eval_every=200", "seed=0,1,2")
    proc = warm.popen(cmd, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: record_lines(sweep, 1) >= 10, 400, "job 1 training")
        pid = json.loads((sweep / ".trackdiag" / "jobs" / "1.start.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=1200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0  # submitit reports job 1 as never completed
    done = wait_for(lambda: (f := finalized(sweep)) and f["jobs"] == [0, 1, 2] and f, 600, "the sweep's comparison")
    assert done["dead"] == [1]
    from mlflow import MlflowClient

    client = MlflowClient(server.uri)
    parent, kids = sweep_runs(client, "killed", sweep)
    status = {int(r.data.tags["trackdiag.job_num"]): r.info.status for r in kids}
    assert status == {0: "FINISHED", 1: "KILLED", 2: "FINISHED"}, err[-3000:]
    assert parent.info.status == "KILLED"
    assert missing_points(client, kids) == {}  # the killed job's last points came from its local record
    for num in (0, 2):
        assert json.loads((sweep / str(num) / "diag" / "summary.json").read_text())["steps"] == 2500
    logged = json.loads(Path(client.download_artifacts(parent.info.run_id, "trackdiag/comparison.json",
                                                       str(tmp_path))).read_text())
    marks = {r["job_num"]: (r["status"], r["display_health"]) for r in logged["runs"]}
    assert marks[1] == ("KILLED", "failed") and marks[0][0] == marks[2][0] == "FINISHED"

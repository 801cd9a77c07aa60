"""The MLflow delivery worker is kept between the sessions of one process (trackdiag.sinks.mlflow.pipe).

Real SQLite stores and real worker processes. The sessions of a joblib or Optuna sweep, or a notebook, run one
after another in one Python: each used to start its own worker (~2 s of CPU importing MLflow, ~4 s with a new
store's tables). Checked here: the second session's run is delivered by the first's worker, point for point;
a change of environment gets a worker of its own (one is kept per process, the other sent away), a change of
directory keeps it (it moves there);
a worker kept while its parent is killed ends no run; a parent that exits leaves no worker behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.sinks.mlflow import pipe  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

import _warm as warm  # noqa: E402
from _mlflow_util import history, local_points, same_points, tiny_model, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, store: str, name: str) -> str:
    """One session of 12 steps delivered to ``store``; its MLflow run id."""
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / name),
                                 probes={"report": {"enabled": False}},
                                 sink={"mlflow": {"tracking_uri": store, "experiment": "kept"}})
    with diag:
        train(diag, model, opt, range(12))
    return next(s for s in diag._hub.sinks if isinstance(s, MlflowSink)).run_id


def _kept_pid() -> int | None:
    procs = list(pipe._parked.values())
    return procs[0].pid if procs else None


def _workers_with(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (a run's workers inherit its environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark.encode() in (entry / "environ").read_bytes() and \
                        b"trackdiag.sinks.mlflow.worker" in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _gone(mark: str, timeout: float = 20.0) -> bool:
    t0 = time.monotonic()
    while _workers_with(mark):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    yield
    pipe.close_parked()  # the next test starts with none kept


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_second_session_reuses_the_first_ones_worker_and_delivers_every_point(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _run(tmp_path, store, "a")
    kept = _kept_pid()
    assert kept is not None, "the worker of a cleanly closed session is kept"
    second = _run(tmp_path, store, "b")
    assert _kept_pid() == kept, "the second session was delivered by the first one's worker"
    client = MlflowClient(store)
    for run_id, name in ((first, "a"), (second, "b")):
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        local = local_points(tmp_path / name)
        assert local["diag/loss"] and same_points(history(client, run_id, "diag/loss"), local["diag/loss"])
    assert first != second


def test_another_environment_gets_its_own_worker_another_directory_keeps_it(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A setting MLflow reads from the environment: a worker of its own (the other sent away). Another working
    directory (a notebook's ``%cd``, Hydra's ``hydra.job.chdir=True`` jobs in one joblib process): the same
    worker, which serves the session from there: a run directory given relative to it gets its files uploaded."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _run(tmp_path, store, "a")
    first = _kept_pid()
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "61")  # a setting MLflow reads from the environment
    _run(tmp_path, store, "b")
    second = _kept_pid()
    assert second is not None and second != first
    assert len(pipe._parked) == 1, "one worker kept per process; the other was sent away"
    for where in ("elsewhere", "further"):
        (tmp_path / where).mkdir()
        monkeypatch.chdir(tmp_path / where)
        run_id = _run(Path("."), store, "c")  # the run's directory relative to the new working directory
        assert _kept_pid() == second and len(pipe._parked) == 1
        client = MlflowClient(store)
        assert client.get_run(run_id).info.status == "FINISHED"
        (local,) = (tmp_path / where / "c").rglob("diag_config.yaml")  # the sink's copy, under the relative run dir
        got = Path(client.download_artifacts(run_id, "trackdiag/diag_config.yaml", str(tmp_path / f"dl-{where}")))
        assert got.read_text() == local.read_text()
    client = MlflowClient(store)
    runs = client.search_runs([client.get_experiment_by_name("kept").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 4


def test_sessions_of_different_pytest_tests_share_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest sets ``PYTEST_CURRENT_TEST`` for each phase of each test: a user's test suite that runs their loop
    with the MLflow sink in several tests shares one worker, as a notebook does (MLflow never reads it)."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_one (call)")
    _run(tmp_path, store, "a")
    kept = _kept_pid()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/test_a.py::test_two (call)")
    _run(tmp_path, store, "b")
    assert kept is not None and _kept_pid() == kept


def test_the_users_own_mlflow_import_keeps_the_worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's telemetry writes its session id into the environment of the process that imports MLflow (a user
    reading a run back with ``MlflowClient`` between sessions): the next session keeps the worker (issue 47: the
    suite's in-process MLflow tests started one more worker each time)."""
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.delenv("_MLFLOW_TELEMETRY_SESSION_ID", raising=False)
    _run(tmp_path, store, "a")
    kept = _kept_pid()
    monkeypatch.setenv("_MLFLOW_TELEMETRY_SESSION_ID", uuid.uuid4().hex)  # what mlflow.telemetry sets
    _run(tmp_path, store, "b")
    assert kept is not None and _kept_pid() == kept


def _script(tmp_path: Path, body: str, mark: str) -> subprocess.Popen[str]:
    (tmp_path / "job.py").write_text(textwrap.dedent('''
        import sys, time
        import torch
        from torch import nn
        import trackdiag

        def run(name, store, steps=12):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=name,
                                         probes={"report": {"enabled": False}},
                                         sink={"mlflow": {"tracking_uri": store, "experiment": "kept"}})
            with diag:
                for _ in range(steps):
                    loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
                    loss.backward(); opt.step(); opt.zero_grad(); diag.step(loss)
        ''') + textwrap.dedent(body))
    env = {**os.environ, "TD_KEPT_MARK": mark, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    return warm.popen([sys.executable, "job.py", f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path, env=env,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_process_that_exits_leaves_no_worker_and_every_run_finished(tmp_path: Path) -> None:
    mark = uuid.uuid4().hex
    proc = _script(tmp_path, '''
        for name in ("a", "b", "c"):
            run(name, sys.argv[1])
        ''', mark)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert _gone(mark), "the kept worker outlived its parent"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("kept").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED"] * 3


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")
def test_a_killed_parent_with_a_kept_worker_ends_no_run(tmp_path: Path) -> None:
    """Killed after its run finished, while its worker is kept: the run stays FINISHED (the kept worker holds
    no run), and the worker exits."""
    mark = uuid.uuid4().hex
    proc = _script(tmp_path, '''
        run("a", sys.argv[1])
        print("closed", flush=True)
        time.sleep(600)
        ''', mark)
    try:
        assert proc.stdout.readline().strip() == "closed", proc.stderr.read()[-3000:]  # type: ignore[union-attr]
        assert len(_workers_with(mark)) == 1, "the worker is kept while the parent lives"
        os.killpg(proc.pid, signal.SIGKILL)  # the parent only: the worker is in a session of its own
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert _gone(mark), "the kept worker outlived its killed parent"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("kept").experiment_id])
    assert run.info.status == "FINISHED"

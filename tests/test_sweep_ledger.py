"""The parts of a parallel sweep that need no server: the ledger's view of which jobs ended or died,
the job count of a grid, duplicate parent runs merged, the summary tag, and a killed training
process whose run its orphaned delivery worker ends KILLED (real SQLite stores, real processes)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from trackdiag.hydra import sweep_ledger as ledger
from trackdiag.compare.mlflow_source import _summary
from trackdiag.sinks.mlflow.sweep import find_parents, merge_parents, summary_tag, sweep_status

import _warm as warm


def _config(*task: str, sweeper: str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
            params: dict[str, str] | None = None) -> object:
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": sweeper, "params": params or {}},
                                       "overrides": {"task": list(task)}}})


def test_expected_jobs_is_the_grid_size() -> None:
    assert ledger.expected_jobs(_config("seed=0,1", "fault=none,nan_input,lr_explode,crash", "steps=30")) == 8
    assert ledger.expected_jobs(_config("seed=range(0,64)", "+diag=advanced")) == 64
    assert ledger.expected_jobs(_config("lr=1,2", params={"seed": "0,1,2"})) == 6
    assert ledger.expected_jobs(_config("steps=30")) == 1
    assert ledger.expected_jobs(_config("model=glob(*)")) is None  # needs Hydra's config loader
    assert ledger.expected_jobs(_config("seed=0,1", sweeper="hydra_plugins.optuna.OptunaSweeper")) is None


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_progress_ended_running_dead_and_moved_on(tmp_path: Path) -> None:
    ledger.start_sweep(tmp_path, expected=4)
    ledger.job_started(tmp_path, 0)
    ledger.job_ended(tmp_path, 0, {"status": "COMPLETED"})
    ledger.job_started(tmp_path, 1)  # this process, alive: still running
    p = ledger.progress(tmp_path)
    assert sorted(p.ended) == [0] and p.running == [1] and not p.over
    me = ledger.me()
    ledger.write_json(ledger.state(tmp_path) / "jobs" / "2.start.json", {**me, "pid": _dead_pid(), "pstart": None})
    # job 1's process (a loky worker) moved on to job 3: job 1 died without an end
    ledger.write_json(ledger.state(tmp_path) / "jobs" / "3.start.json", {**me, "time": me["time"] + 5})
    p = ledger.progress(tmp_path)
    assert p.dead == [1, 2] and p.running == [3] and not p.over
    ledger.job_ended(tmp_path, 3, {"status": "FAILED"})
    p = ledger.progress(tmp_path)
    assert p.over and p.covered == [0, 1, 2, 3]
    other_host = {**me, "host": "elsewhere", "time": me["time"] + 9}
    ledger.write_json(ledger.state(tmp_path) / "jobs" / "4.start.json", other_host)
    assert ledger.progress(tmp_path).running == [4]  # another machine's process: not judged dead


def test_without_a_count_the_launcher_decides(tmp_path: Path) -> None:
    ledger.start_sweep(tmp_path, expected=None)
    ledger.job_started(tmp_path, 0)
    ledger.job_ended(tmp_path, 0, {"status": "COMPLETED"})
    assert not ledger.progress(tmp_path).over
    ledger.launcher_done(tmp_path, all_returned=False)
    assert ledger.progress(tmp_path).over
    ledger.start_sweep(tmp_path, expected=None)  # a new multirun into the same dir forgets the old one
    assert ledger.progress(tmp_path).ended == {} and ledger.progress(tmp_path).launcher_done is None


def test_duplicate_parents_are_merged_into_the_earliest(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from _mlflow_util import ready_store

    client = MlflowClient(ready_store(tmp_path))
    eid = client.create_experiment("dup")
    group = str(tmp_path / "multirun" / "it's")  # a quote in the sweep dir
    tags = {"trackdiag.role": "sweep", "trackdiag.sweep": group}
    first = client.create_run(eid, start_time=1000, tags=tags).info.run_id
    second = client.create_run(eid, start_time=2000, tags=tags).info.run_id
    client.create_run(eid, tags={**tags, "trackdiag.sweep": group + "-other"})  # another sweep: untouched
    kids = [client.create_run(eid, tags={"mlflow.parentRunId": p}).info.run_id for p in (first, second, second)]
    assert [r.info.run_id for r in find_parents(client, [eid], group)] == [first, second]
    assert merge_parents(client, [eid], group) == first
    assert [r.info.run_id for r in find_parents(client, [eid], group)] == [first]
    assert {client.get_run(k).data.tags["mlflow.parentRunId"] for k in kids} == {first}
    assert client.get_run(second).info.lifecycle_stage == "deleted"


def test_summary_tag_round_trip_and_cut() -> None:
    summary = {"steps": 30, "health": "critical",
               "alerts": {"nonfinite_loss": {"count": 1, "first_step": 12, "severity": "critical", "where": "x"},
                          "loss_spike": {"count": 3, "first_step": 5, "severity": "info"}}}
    back = _summary(summary_tag(summary))
    assert back == {"steps": 30, "health": "critical",
                    "alerts": {"nonfinite_loss": [1, 12, "critical"], "loss_spike": [3, 5, "info"]}}
    many = {"steps": 1, "health": "warning",
            "alerts": {f"kind_{i:04d}_{'x' * 40}": {"count": i, "first_step": i, "severity": "warning"}
                       for i in range(400)}}
    text = summary_tag(many)
    assert len(text) <= 8000 and json.loads(text)["cut"] and "kind_0399" in text and "kind_0000" not in text
    assert _summary("not json") is None and _summary('{"alerts": {"k": 1}}') is None
    assert [sweep_status(s) for s in (["FINISHED"], ["FINISHED", "KILLED"], ["KILLED", "FAILED"])] == \
        ["FINISHED", "KILLED", "FAILED"]


KILLED_PROCESS = r"""
import os, signal, sys, time
import torch
import trackdiag
from trackdiag.sinks.mlflow.sink import MlflowSink
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local", "mlflow"], output_dir=sys.argv[2],
                             sink={"mlflow": {"tracking_uri": sys.argv[1], "experiment": "killed"}})
sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
step, t0 = 0, time.monotonic()
while time.monotonic() - t0 < 240:  # until the worker has its run: it yields while training runs (on a busy machine
    step += 1                       # the run came after the 8 s a fixed 400 steps took, and training ended unkilled)
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    diag.step(loss)
    diag.flush()
    if sink.run_id and step > 50:
        print(sink.run_id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
"""


@pytest.mark.slow
def test_a_killed_process_run_is_ended_killed_by_its_worker(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from _mlflow_util import ready_store

    uri = ready_store(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    proc = warm.run([sys.executable, "-c", KILLED_PROCESS, uri, str(tmp_path / "run")], capture_output=True,
                    text=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    run_id = proc.stdout.split()[0]
    client = MlflowClient(uri)
    t0 = time.monotonic()
    while client.get_run(run_id).info.status == "RUNNING" and time.monotonic() - t0 < 60:
        time.sleep(0.5)
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["trackdiag.status"] == "KILLED"
    assert run.data.tags["trackdiag.health"] == "killed"


def test_bulk_histories_pack_cut_and_read_long_runs_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from _mlflow_util import ready_store
    from trackdiag.compare import mlflow_history

    client = MlflowClient(ready_store(tmp_path))
    eid = client.create_experiment("bulk")
    sizes = [30, 40, 120, 7, 0]  # 120 > one answer: read alone; 0: a run without the key
    ids = []
    for n in sizes:
        rid = client.create_run(eid).info.run_id
        if n:
            client.log_batch(rid, metrics=[Metric("diag/loss", float(i) / 3, 1000 + i, i) for i in range(n)])
        ids.append(rid)
    monkeypatch.setattr(mlflow_history, "MAX_POINTS", 50)  # the server's 25,000, scaled down
    monkeypatch.setattr(mlflow_history, "MAX_RUNS", 2)
    got = mlflow_history.histories(client, {r: 10 for r in ids}, "diag/loss")
    assert got is not None
    assert {r: len(got[r]) for r in ids} == dict(zip(ids, sizes))
    assert all(got[r] == [(i, float(i) / 3) for i in range(n)] for r, n in zip(ids, sizes))
    assert mlflow_history._batches({"a": 30, "b": 30, "c": 5}) == [["a"], ["b", "c"]]

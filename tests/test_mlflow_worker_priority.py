"""The MLflow delivery worker gives the CPU to training first (trackdiag.sinks.mlflow.priority).

A real worker process: its scheduling group (its own session is its own Linux autogroup, where ``nice`` inside it
weighs nothing against training) is at nice 19 from its first line until its run exists, then 10; its own nice is
10. The starvation fallback (no run after ``STARVED`` seconds) is checked on a file standing in for
``/proc/self/autogroup``. What this buys is measured by ``benchmarks/tracker_startup.py`` (docs/performance.md).
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

import trackdiag
from trackdiag.sinks.mlflow import pipe, priority
from trackdiag.sinks.mlflow.pipe import send
from trackdiag.sinks.mlflow.worker import child_command

from _mlflow_util import tiny_model, train

HAS_AUTOGROUP = priority.autogroup_nice() is not None


def _poll(read, want, timeout: float = 60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = read()
        if got == want:
            return got
        time.sleep(0.02)
    return read()


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="no Linux autogroup here (/proc/self/autogroup)")
def test_worker_group_yields_until_its_run_exists_then_keeps_a_share(tmp_path: Path) -> None:
    # a worker before any request: the import and the store are still to come, in the gaps training leaves
    env = {**os.environ, "PYTHONPATH": str(Path(priority.__file__).resolve().parents[3])}
    proc = subprocess.Popen(child_command("trackdiag.sinks.mlflow.worker"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, start_new_session=True, cwd=tmp_path)
    try:
        assert _poll(lambda: priority.autogroup_nice(Path(f"/proc/{proc.pid}/autogroup")), priority.START) == \
            priority.START
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == priority.STEADY
        assert priority.autogroup_nice() != priority.START  # the test's own group is untouched
        send(proc.stdin, {"bye": True})
        proc.stdin.close()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # a session's worker once its run exists: a steady share (it is kept for the next session: read it there)
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / "run"),
                                 probes={"report": {"enabled": False}},
                                 sink={"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
                                                  "experiment": "priority"}})
    with diag:
        train(diag, model, opt, range(12))
    kept = list(pipe._parked.values())
    assert kept, "the session's worker was not kept"
    try:
        assert priority.autogroup_nice(Path(f"/proc/{kept[0].pid}/autogroup")) == priority.STEADY
    finally:
        pipe.close_parked()


def test_a_starved_worker_takes_its_steady_share_after_a_while(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "autogroup"
    fake.write_text("/autogroup-7 nice 0\n")
    monkeypatch.setattr(priority, "STARVED", 0.3)
    y = priority.Yielding(fake, own_nice=False)  # own_nice: this test process keeps its priority
    y.start()
    assert priority.autogroup_nice(fake) == priority.START
    assert _poll(lambda: priority.autogroup_nice(fake), priority.STEADY, 10) == priority.STEADY
    fake.write_text(str(priority.START))
    y.settle()  # once only: a later settle changes nothing
    assert priority.autogroup_nice(fake) == priority.START

    none = priority.Yielding(tmp_path / "missing", own_nice=False)
    none.start()
    none.settle()
    assert not (tmp_path / "missing").exists()  # no autogroup: nothing written

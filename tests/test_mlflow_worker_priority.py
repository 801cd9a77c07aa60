"""The MLflow delivery worker gives the CPU to training first (trackdiag.sinks.mlflow.priority).

A real worker process: its scheduling group (its own session is its own Linux autogroup, where ``nice`` inside it
weighs nothing against training) is at nice 19 from its first line until its run exists, then 10; its own nice is
10; at 0 once its session closes (even before its run exists), and kept, back to 10 for the next session. The
starvation fallback (no run after ``STARVED`` seconds) is checked on a file standing in for ``/proc/self/autogroup``. What this buys is measured by ``benchmarks/tracker_startup.py`` (docs/performance.md).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import trackdiag
from trackdiag.sinks.mlflow import pipe, priority
from trackdiag.sinks.mlflow.deliver import Deliverer
from trackdiag.sinks.mlflow.pipe import send
from trackdiag.sinks.mlflow.sink import MlflowSink
from trackdiag.sinks.mlflow.spool import Spool
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
    # a session's worker once its run exists: a steady share while training; at nice 0 once the session closes (what
    # is left is what the user waits for); kept, it serves the next session at the steady share again
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    seen: list[int | None] = []

    def session(name: str) -> None:
        model, opt = tiny_model()
        diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / name),
                                     probes={"report": {"enabled": False}},
                                     sink={"mlflow": {"tracking_uri": store, "experiment": "priority"}})
        with diag:
            train(diag, model, opt, range(12))
            diag.flush()
            deliver = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))._deliver

            def group_now() -> int | None:  # the worker's group, once the delivery thread has one (and its run)
                runner = deliver._runner
                return None if runner is None else priority.autogroup_nice(Path(f"/proc/{runner._proc.pid}/autogroup"))

            seen.append(_poll(group_now, priority.STEADY, 60))

    try:
        session("one")
        kept = list(pipe._parked.values())
        assert kept, "the session's worker was not kept"
        group = Path(f"/proc/{kept[0].pid}/autogroup")
        assert _poll(lambda: priority.autogroup_nice(group), priority.HURRY, 5) == priority.HURRY
        session("two")
        assert list(pipe._parked.values()) == kept  # the same worker served the second session
        assert seen == [priority.STEADY, priority.STEADY]
        assert _poll(lambda: priority.autogroup_nice(group), priority.HURRY, 5) == priority.HURRY
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

    # a session that closed before the worker's run existed hurried its group: the run's arrival leaves it there
    hurried = priority.Yielding(fake, own_nice=False)
    hurried.start()
    fake.write_text(str(priority.HURRY))
    hurried.settle()
    assert priority.autogroup_nice(fake) == priority.HURRY

    none = priority.Yielding(tmp_path / "missing", own_nice=False)
    none.start()
    none.settle()
    assert not (tmp_path / "missing").exists()  # no autogroup: nothing written


@pytest.mark.skipif(not HAS_AUTOGROUP, reason="no Linux autogroup here (/proc/self/autogroup)")
def test_a_worker_still_starting_when_the_session_closes_is_hurried(tmp_path: Path) -> None:
    """The deliverer learns its worker's pid at the spawn, before the worker answers (its MLflow import takes seconds on
    a busy machine, at nice 19): a session closing meanwhile hurries it; one spawned while training goes on is left be."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    group = Path(f"/proc/{proc.pid}/autogroup")
    try:
        assert _poll(lambda: priority.set_group(proc.pid, priority.START, 4), True, 5)
        deliver = Deliverer(Spool(tmp_path / "spool"), {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"})
        deliver.spawned(proc.pid)  # training goes on: the worker yields
        time.sleep(0.3)
        assert priority.autogroup_nice(group) == priority.START
        with deliver._cv:
            deliver._closing = True
        deliver.spawned(proc.pid)  # the session closes while it starts (close() hurries the pid it knows the same way)
        assert _poll(lambda: priority.autogroup_nice(group), priority.HURRY, 5) == priority.HURRY
    finally:
        proc.kill()
        proc.wait(10)
    # a worker hurried the moment it was spawned, before its first line set its group to START: the hurry waits for
    # that, so the worker does not undo it (its run arriving later leaves it at HURRY: settle)
    env = {**os.environ, "PYTHONPATH": str(Path(priority.__file__).resolve().parents[3])}
    proc = subprocess.Popen(child_command("trackdiag.sinks.mlflow.worker"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, start_new_session=True, cwd=tmp_path)
    try:
        priority.hurry(proc.pid)
        group = Path(f"/proc/{proc.pid}/autogroup")
        assert _poll(lambda: priority.autogroup_nice(group), priority.HURRY, 10) == priority.HURRY
        time.sleep(0.5)
        assert priority.autogroup_nice(group) == priority.HURRY
    finally:
        proc.kill()
        proc.wait(10)


def test_an_orphaned_worker_hurries_itself_before_it_ends_the_run_killed(tmp_path: Path, monkeypatch) -> None:
    """The training process was killed: the worker ends its run KILLED at nice 0, not at its steady 10 (a sweep or
    a user waits on it). The group is read when the run is being ended."""
    from trackdiag.sinks.mlflow import worker

    fake = tmp_path / "autogroup"
    fake.write_text("/autogroup-7 nice 0\n")
    y = priority.Yielding(fake, own_nice=False)
    y.start()
    y.settle()
    assert priority.autogroup_nice(fake) == priority.STEADY

    class Runner:  # stands in for run.Runner: records the group its abandon ran under
        state = {"run_id": "r1"}
        seen: list[int | None] = []

        def abandon(self) -> bool:
            self.seen.append(priority.autogroup_nice(fake))
            return True

    monkeypatch.setattr(worker, "_priority", [y])
    monkeypatch.setattr(worker, "_abandoned", [])
    worker._abandon(Runner())
    worker._abandon(Runner())  # once only
    assert Runner.seen == [priority.HURRY]

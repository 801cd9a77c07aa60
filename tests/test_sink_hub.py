"""The sink hub under Ctrl-C: a KeyboardInterrupt can reach the training thread between any two
bytecodes, including inside the hub's own ``write``. Whatever it interrupts, everything queued is
still handled and ``drain``/``close`` return (with ``queue.Queue`` an interrupt inside ``put`` could
queue an item without waking the sink thread, and the run's close then waited forever)."""
from __future__ import annotations

import _thread
import gc
import random
import signal
import threading
import time

from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.base import Sink, SinkHub


class _Count(Sink):
    name = "count"

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.calls: list[str] = []
        self.closed: str | None = None

    def write(self, record: Record) -> None:
        self.steps.append(record.step)
        self.calls.append("write")

    def flush(self) -> None:
        self.calls.append("flush")

    def close(self, status: str, summary: dict) -> None:
        self.closed = status


def _run_info(tmp_path) -> RunInfo:
    return RunInfo(name="hub", output_dir=tmp_path, level="basic", config={})


def test_every_write_a_ctrl_c_lets_through_is_handled_and_drain_returns(tmp_path) -> None:
    # Python's own Ctrl-C handler, as in a user's script (an xdist worker may hold SIGINT otherwise, and then
    # ``interrupt_main`` does nothing: the conftest fixture puts the worker's handler back afterwards)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # no collection during the trials: a KeyboardInterrupt that lands in a finalizer the collector runs (an
    # earlier test's socket or Popen) is printed as "Exception ignored" and lost, and the loop never hears of it
    gc.collect()
    gc.disable()
    try:
        _interrupted_writes(tmp_path)
    finally:
        gc.enable()


def _interrupted_writes(tmp_path) -> None:
    rng = random.Random(0)
    for trial in range(40):
        sink = _Count()
        hub = SinkHub([sink])
        hub.open(_run_info(tmp_path))
        sent: list[int] = []
        timer = threading.Timer(rng.uniform(0.0, 0.004), _thread.interrupt_main)  # a Ctrl-C, mid-loop
        interrupted = False
        try:
            timer.start()
            for step in range(20_000):  # ~0.1 s of writes: the interrupt comes within the first ~12,000 when idle
                hub.write(Record(step=step, time=0.0))
                sent.append(step)
            # a timer thread the OS left waiting on a busy machine: the interrupt comes after the writes
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                time.sleep(0.002)
        except KeyboardInterrupt:
            interrupted = True
        finally:
            timer.cancel()
        assert interrupted, f"trial {trial}: the Ctrl-C never came"
        drained = threading.Thread(target=hub.drain, daemon=True)
        drained.start()
        drained.join(10.0)
        assert not drained.is_alive(), f"trial {trial}: the sink thread never reached the end of the queue"
        # every write that returned was handled; the one interrupted may or may not have been queued
        assert sink.steps[:len(sent)] == sent and len(sink.steps) - len(sent) in (0, 1), trial
        hub.close("KILLED", {}, timeout=10.0)
        assert sink.closed == "KILLED"


def test_drain_returns_once_the_thread_is_gone(tmp_path) -> None:
    sink = _Count()
    hub = SinkHub([sink])
    hub.open(_run_info(tmp_path))
    hub.write(Record(step=0, time=0.0))
    hub.close("FINISHED", {}, timeout=10.0)
    assert sink.steps == [0] and sink.closed == "FINISHED"
    t0 = time.monotonic()
    assert hub.drain() is True  # nothing left to wait for: at once
    assert time.monotonic() - t0 < 1.0


def test_drain_returns_after_what_it_waited_for_is_flushed(tmp_path) -> None:
    """``flush()`` (``diag.flush()``) means handed on: a tracker sink has been told to deliver, also
    when the drain was asked for while the last write was still being handled."""
    gate = threading.Event()

    class _Slow(_Count):
        def write(self, record: Record) -> None:
            gate.wait(10.0)
            super().write(record)

    sink = _Slow()
    hub = SinkHub([sink])
    hub.open(_run_info(tmp_path))
    hub.write(Record(step=0, time=0.0))
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(hub.drain(timeout=10.0)))
    waiter.start()
    time.sleep(0.2)  # the drain is queued behind the write in progress
    gate.set()
    waiter.join(10.0)
    assert result == [True] and sink.calls[-2:] == ["write", "flush"]  # (a flush after open may come first)
    hub.close("FINISHED", {}, timeout=10.0)

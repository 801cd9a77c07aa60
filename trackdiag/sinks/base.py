"""The :class:`Sink` contract and the background thread that feeds every sink."""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, ClassVar, Sequence

from trackdiag.core.alert import Alert
from trackdiag.core.errors import brief
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo

log = logging.getLogger("trackdiag")


class Sink:
    """Receives, on a background thread and in order: ``open`` once, then ``write`` per record and
    ``alert`` per emitted alert, ``flush`` whenever the queue runs dry (batch here), ``close`` once.

    A sink that raises is disabled with one warning; training never sees the error.
    ``status`` at close is ``FINISHED`` | ``FAILED`` | ``KILLED``; the summary carries it too
    (``summary["status"]``). ``close_budget``: the most seconds ``close`` may take (the hub waits
    that long, plus a margin, before it gives up on the sink thread).
    """

    name: ClassVar[str] = ""
    close_budget: float = 60.0

    def open(self, run: RunInfo) -> None:
        """Start the run. Default: nothing."""

    def write(self, record: Record) -> None:
        """Take one record (scalars, series, tables, histograms, artifacts). Default: nothing."""

    def alert(self, alert: Alert) -> None:
        """Take one emitted alert. Default: nothing."""

    def flush(self) -> None:
        """Deliver what is buffered. Default: nothing."""

    def close(self, status: str, summary: dict[str, Any]) -> None:
        """End the run with ``status``; ``summary`` is ``Diagnostics.summary()``. Default: nothing."""

    def interrupt(self) -> None:
        """Called from the training thread (a second Ctrl-C): make a ``close`` that waits stop waiting
        and keep what is left. Default: nothing."""


_STOP = object()


class _Barrier:
    """A queue item the sink thread releases on reaching it: everything queued before it is handled."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()


class SinkHub:
    """Feeds sinks from a queue on one daemon thread so tracker I/O never blocks training.
    ``cpu_seconds``: CPU time that thread has spent on sinks (it competes with training for cores
    and the GIL, so it is part of the diagnostics' cost; reported in ``summary()["overhead"]``).

    The training thread only ever calls ``SimpleQueue.put`` (one C call) and waits on a plain lock:
    a Ctrl-C's KeyboardInterrupt can arrive between any two bytecodes of the training thread, and
    inside ``queue.Queue.put`` (Python code around a ``Condition``) it can land after the item is
    queued but before the sink thread is woken. The sink thread then slept on a non-empty queue and
    ``close`` waited for it forever (seen under load: the run never ended after Ctrl-C)."""

    def __init__(self, sinks: Sequence[Sink]) -> None:
        self.sinks = list(sinks)
        self.cpu_seconds = 0.0
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="trackdiag-sinks", daemon=True)
        self._failed: set[str] = set()

    def open(self, run: RunInfo) -> None:
        self._q.put(("open", (run,)))
        self._thread.start()

    def write(self, record: Record) -> None:
        self._q.put(("write", (record,)))

    def alert(self, alert: Alert) -> None:
        self._q.put(("alert", (alert,)))

    def close(self, status: str, summary: dict[str, Any], timeout: float | None = None) -> None:
        """Deliver everything queued, close every sink, and wait for the thread: ``timeout`` s, or
        (None) the largest ``close_budget`` of the sinks plus 30 s. A KeyboardInterrupt (or the
        SystemExit of a SIGTERM) while waiting asks the sinks that can (``interrupt()``) to stop at
        once and keep what is left (the MLflow spool), then propagates."""
        self._q.put(("close", (status, summary)))
        self._q.put(_STOP)
        if timeout is None:
            timeout = max([s.close_budget for s in self.sinks] or [0.0]) + 30.0
        if self._thread.is_alive():
            try:
                self._thread.join(timeout)
            except BaseException:
                self.interrupt()
                self._thread.join(5.0)
                raise
            if self._thread.is_alive():
                log.warning("trackdiag: sinks still busy after %.0fs; the local record is complete, trackers may lag", timeout)

    def interrupt(self) -> None:
        """Ask every sink to stop waiting at close and keep what is left (a second Ctrl-C: see Sink.interrupt)."""
        for sink in self.sinks:
            sink.interrupt()

    def drain(self, timeout: float = -1) -> bool:
        """Block until every item queued so far is handled (tests, checkpoints, the end-of-run
        files); at most ``timeout`` s when given. Whether it was."""
        if not self._thread.is_alive():
            return True
        barrier = _Barrier()
        self._q.put(barrier)
        end = None if timeout < 0 else time.monotonic() + timeout
        while not barrier.lock.acquire(timeout=0.5 if end is None else max(0.0, min(0.5, end - time.monotonic()))):
            if not self._thread.is_alive() or (end is not None and time.monotonic() >= end):
                return False  # the thread ended (closed, or died) before reaching it; or out of time
        return True

    def _run(self) -> None:
        unflushed = False
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            c0 = time.thread_time()
            if isinstance(item, _Barrier):  # what came before is handled, and handed on (flushed)
                if unflushed:
                    self._call("flush", ())
                    unflushed = False
                item.lock.release()
            else:
                method, args = item
                self._call(method, args)
                unflushed = method != "close"
                if unflushed and self._q.empty():
                    self._call("flush", ())
                    unflushed = False
            self.cpu_seconds += time.thread_time() - c0

    def _call(self, method: str, args: tuple[Any, ...]) -> None:
        for sink in self.sinks:
            if sink.name in self._failed:
                continue
            try:
                getattr(sink, method)(*args)
            except Exception as exc:  # a sink must never take training down
                self._failed.add(sink.name)
                log.warning("trackdiag: sink %r disabled after %s in %s()", sink.name, brief(exc), method)

"""How the MLflow deliverer ends: wait while delivery moves, give up only on silence or the cap.

:meth:`CloseWait.close` first puts everything pending on disk (the spool, the ``end`` op with
it), so a Ctrl-C or a kill while waiting loses nothing: ``trackdiag sync`` (or the next session)
delivers it. Then it waits as long as ops keep being delivered, and gives up only when

- nothing was delivered for ``stall`` seconds *and* the store does not answer (an outage that
  persists, or a server whose ``/health`` does not answer), or
- the whole wait reaches ``cap`` seconds (then, if the server answers, the run's status is set
  anyway by a separate short-lived worker, and the rest stays spooled with the ``end`` op), or
- :meth:`interrupt` is called (Ctrl-C while the session waits).

``progress(done, total)`` is called about 4 times a second with (metric points, files) pairs.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from trackdiag.sinks.mlflow.batch import group_summary
from trackdiag.sinks.mlflow.priority import hurry
from trackdiag.sinks.mlflow.spool import Spool
from trackdiag.sinks.mlflow.store import healthy

log = logging.getLogger("trackdiag")

Progress = Callable[[tuple[int, int], tuple[int, int]], None]


class CloseWait:
    """Mixin for :class:`~trackdiag.sinks.mlflow.deliver.Deliverer` (uses its lock and state)."""

    _cv: threading.Condition
    _stop: bool
    _closing: bool
    _retry_at: float
    _delay: float
    _down_since: float | None
    _broken: str | None
    _runner: Any
    _worker_pid: int | None
    _health: str | None
    _factory: Callable[[dict[str, Any]], Any]
    _thread: threading.Thread
    spool: Spool
    state: dict[str, Any]
    done: list[int]
    _interrupted = False

    def _idle(self) -> bool: ...  # noqa: E704
    def _persist(self) -> None: ...  # noqa: E704

    def interrupt(self) -> None:
        """Stop waiting at once (what is left stays spooled)."""
        with self._cv:
            self._interrupted = True
            self._cv.notify_all()

    def spawned(self, pid: int) -> None:
        """A delivery worker process runs for this deliverer (``ProcessRunner``'s ``on_spawn``, before it has answered):
        hurried at once when the session is closing already (:func:`~trackdiag.sinks.mlflow.priority.hurry`)."""
        with self._cv:
            self._worker_pid = pid
            closing = self._closing
        if closing:
            hurry(pid)

    def pending(self) -> tuple[int, int]:
        """(metric points, files) not delivered yet, counted from the spool (call after ``_persist``)."""
        entities = files = 0
        for seg in self.spool.segments():
            e, f = group_summary(Spool.load(seg))
            entities, files = entities + e, files + f
        return entities, files

    def close(self, cap: float, stall: float = 30.0, progress: Progress | None = None) -> tuple[tuple[int, int], str | None]:
        """Wait for delivery (see the module doc), stop the thread and the worker.
        Returns ((ops, entities) left in the spool for ``trackdiag sync``, why it gave up or None)."""
        with self._cv:
            self._closing = True
            self._retry_at = 0.0  # one more try right now if we were backing off
            self._persist()
            done0 = (self.done[0], self.done[1])
            total = self.pending()
            self._cv.notify_all()
            pid = self._worker_pid
        if pid is not None:  # training is over: the worker need not yield any more
            hurry(pid)
        t0 = last_move = last_probe = time.monotonic()
        last_done = tuple(self.done)
        why: str | None = None
        at_cap = False
        while True:
            with self._cv:
                if self._idle() or self._broken is not None:
                    break
                now = time.monotonic()
                if tuple(self.done) != last_done:
                    last_done, last_move = tuple(self.done), now
                if self._interrupted:
                    why = "interrupted"
                elif now - t0 >= cap:
                    why = f"still delivering after close_timeout={cap:g}s"
                    at_cap = True
                elif now - last_move >= stall and self._down_since is not None:
                    why = f"no answer from {self.state['tracking_uri']} for {now - last_move:.0f}s"
                elif now - last_move >= stall and self._health and now - last_probe >= 5.0:
                    last_probe = now
                    if not healthy(self._health, timeout=5.0):
                        why = f"{self._health} does not answer"
                if why:
                    break
                if self._delay and self._retry_at > now + 1.0:  # down: retry every second while we wait
                    self._retry_at = now + 1.0
                    self._cv.notify_all()
                self._cv.wait(0.25)
            if progress is not None:
                progress((self.done[0] - done0[0], self.done[1] - done0[1]), total)
        if progress is not None:
            progress((self.done[0] - done0[0], self.done[1] - done0[1]), total)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
            self._persist()
            left = self.spool.counts()
        runner, self._runner = self._runner, None
        if runner is not None and hasattr(runner, "close"):
            runner.close()  # the worker process; an op still in flight there stays spooled
        self._thread.join(0.1)
        if at_cap and left[0]:
            self._end_anyway()
        return left, why

    def _end_anyway(self) -> None:
        """The server answers but delivery did not finish in time: set the run's status now, out of
        order, with a fresh runner (at most ~30 s); the spool keeps the ``end`` op for sync."""
        if not self.state.get("run_id") or not self.state.get("owns_run"):
            return
        end = next((op for seg in self.spool.segments() for op in Spool.load(seg) if op.get("op") == "end"), None)
        if end is None:
            return
        done = threading.Event()

        def run() -> None:
            runner = None
            try:
                runner = self._factory(dict(self.state))
                runner.run(end)
                done.set()
            except Exception as exc:
                log.debug("trackdiag: could not set the MLflow run's status early: %s", exc)
            finally:
                getattr(runner, "close", lambda: None)()

        t = threading.Thread(target=run, name="trackdiag-mlflow-end", daemon=True)
        t.start()
        t.join(30.0)
        if done.is_set():
            log.info("trackdiag: MLflow run %s ended as %s; its remaining data is spooled",
                     self.state.get("run_id"), end.get("status"))

"""The MLflow sink's delivery thread: sends ops in order, spools them to disk during outages.

The sink thread only calls :meth:`Deliverer.submit` (a deque append) so a slow or dead tracking
server never holds up the other sinks, let alone training. When a call fails like an outage
(connection refused, 5xx, timeouts) the deliverer warns once, moves everything pending to the
:class:`Spool`, and retries with exponential backoff (a ``/health`` probe first for servers);
when the server answers again it delivers the spool oldest first, then carries on. Ops MLflow
rejects for good (bad value, missing experiment) are dropped into ``rejected.jsonl``.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trackdiag.sinks._mlflow_ops import is_permanent
from trackdiag.sinks._mlflow_run import NoRun, Runner, health_url, healthy
from trackdiag.sinks._mlflow_spool import Spool

log = logging.getLogger("trackdiag")


class Deliverer:
    """One daemon thread applying ops to MLflow. ``state`` is the run state (see ``Runner``)."""

    def __init__(self, spool: Spool, state: dict[str, Any], *, backoff: float = 1.0, max_backoff: float = 30.0,
                 max_memory_ops: int = 64, max_attempts: int = 5,
                 runner_factory: Callable[[dict[str, Any]], Any] = Runner) -> None:
        self.spool, self.state, self._factory = spool, state, runner_factory
        self.backoff, self.max_backoff = backoff, max_backoff
        self.max_memory_ops, self.max_attempts = max_memory_ops, max_attempts
        self._cv = threading.Condition()
        self._mem: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._seq = 0
        self._inflight: tuple[int, dict[str, Any]] | None = None
        self._cursor: tuple[Path, list[dict[str, Any]], int] | None = None
        self._runner: Any = None  # Runner, or ProcessRunner (same interface, in a child process)
        self._health = health_url(state["tracking_uri"])
        self._retry_at = 0.0           # monotonic time of the next try while down
        self._delay = 0.0              # current backoff (0 = up)
        self._down_since: float | None = None
        self._attempts = 0
        self._rejected = 0
        self._broken: str | None = None
        self._stop = self._closing = False
        self._thread = threading.Thread(target=self._loop, name="trackdiag-mlflow", daemon=True)

    # ------------------------------------------------------------------ sink-thread API
    def start(self) -> None:
        self._thread.start()

    def submit(self, ops: list[dict[str, Any]]) -> None:
        """Queue ops (O(1) each). Beyond ``max_memory_ops`` pending they go to the disk spool."""
        with self._cv:
            for op in ops:
                self._mem.append((self._seq, op))
                self._seq += 1
            if len(self._mem) > self.max_memory_ops:
                self._spill()
            self._cv.notify_all()

    def close(self, timeout: float) -> tuple[int, int]:
        """Wait up to ``timeout`` s for delivery, then stop and spool what is left.
        Returns (ops, entities) left in the spool for ``trackdiag sync``."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._closing = True
            self._retry_at = 0.0  # one more try right now if we were backing off
            self._cv.notify_all()
            while not self._idle() and self._broken is None:
                now = time.monotonic()
                if now >= deadline:
                    break
                if self._delay and self._retry_at > now + 1.0:  # down: retry every second until the deadline
                    self._retry_at = now + 1.0
                    self._cv.notify_all()
                self._cv.wait(min(deadline - now, 0.5))
            self._stop = True
            self._cv.notify_all()
            if self._inflight is not None:  # may be delivered twice; MLflow dedups metrics
                self.spool.write(self._inflight[0], [self._inflight[1]], self.state)
            if self._cursor is not None:
                seg, ops, i = self._cursor
                self.spool.write(Spool.seq_of(seg), ops[i:], self.state)
            self._spill()
            left = self.spool.counts()
        if hasattr(self._runner, "close"):
            self._runner.close()  # the worker process; an op still in flight there stays spooled
        self._thread.join(0.1)
        return left

    @property
    def broken(self) -> str | None:
        """Why delivery stopped for good (the run could not be set up), else None."""
        return self._broken

    # ------------------------------------------------------------------ delivery thread
    def _idle(self) -> bool:
        return not self._mem and self._inflight is None and self._cursor is None and not self.spool.segments()

    def _spill(self) -> None:
        """Move every queued op to one new segment (lock held)."""
        if self._mem:
            self.spool.write(self._mem[0][0], [op for _, op in self._mem], self.state)
            self._mem.clear()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    if self._broken is not None or time.monotonic() < self._retry_at:
                        self._spill()  # cannot deliver now: keep memory bounded, nothing lost
                        wait = None if self._broken is not None else self._retry_at - time.monotonic()
                        self._cv.wait(wait)
                        continue
                    if self._mem or self.spool.segments():
                        break
                    self._cv.notify_all()  # idle: close() may be waiting
                    self._cv.wait()
            try:
                self._round()
            except Exception as exc:  # never let the thread die: treat as an outage
                self._failed({"op": "?"}, exc)

    def _round(self) -> None:
        """Deliver the spool (oldest first), then the queue, until empty or a failure."""
        if self._health is not None and not healthy(self._health):  # before any MLflow call: no long retries
            self._failed({"op": "health"}, ConnectionError(f"no answer from {self._health}"))
            return
        if self._runner is not None and getattr(self._runner, "dead", False):
            self._runner = None  # the worker process died: start a new one
        if self._runner is None:
            try:
                runner = self._factory(self.state)
            except Exception as exc:
                self._failed({"op": "connect"}, exc)
                return
            with self._cv:
                if self._stop:  # closed while the worker was starting: do not leave it behind
                    getattr(runner, "close", lambda: None)()
                    return
                self._runner = runner
        while True:
            with self._cv:
                if self._stop:
                    return
                segs = self.spool.segments()
                if segs:
                    ops = Spool.load(segs[0])
                    self._cursor = (segs[0], ops, 0)
                elif self._mem:
                    self._inflight = self._mem.popleft()
                else:
                    return
            if segs:
                for i, op in enumerate(ops):
                    ok = self._send(op)
                    with self._cv:
                        if self._stop:
                            return
                        if not ok:
                            self._cursor = None
                            self.spool.write(Spool.seq_of(segs[0]), ops[i:], self.state)
                            return
                        self._cursor = (segs[0], ops, i + 1)
                with self._cv:
                    if not self._stop:
                        self._cursor = None
                        segs[0].unlink(missing_ok=True)
            else:
                seq, op = self._inflight  # type: ignore[misc]
                ok = self._send(op)
                with self._cv:
                    if self._stop:
                        return
                    self._inflight = None
                    if not ok:
                        self.spool.write(seq, [op], self.state)
                        self._spill()
                        return

    def _send(self, op: dict[str, Any]) -> bool:
        """Apply one op. True when done (delivered, or dropped as permanently rejected)."""
        try:
            self._runner.run(op)  # type: ignore[union-attr]
        except Exception as exc:
            return self._failed(op, exc)
        if op["op"] == "open" and self.spool.exists():
            with self._cv:
                self.spool.write_meta(self.state)
        self._attempts = 0
        if self._down_since is not None:
            log.info("trackdiag: MLflow at %s is back after %.0fs; delivering what was spooled",
                        self.state["tracking_uri"], time.monotonic() - self._down_since)
            self._down_since, self._delay = None, 0.0
        return True

    def _failed(self, op: dict[str, Any], exc: BaseException) -> bool:
        """Classify a failure: drop it (permanent), stop for good (no run), or back off (outage)."""
        if self._stop:  # closed meanwhile: close() spooled the op; nothing more to say
            return False
        name = op.get("op")
        if isinstance(exc, NoRun) or (name in ("open", "connect") and is_permanent(exc)):
            with self._cv:
                self._broken = f"{type(exc).__name__}: {exc}"
            log.warning("trackdiag: MLflow run set-up failed (%s); records stay spooled in %s, fix it and run "
                        "`trackdiag sync %s`", self._broken, self.spool.dir, self.spool.dir.parent)
            return False
        if name not in ("health", "connect", "?"):
            self._attempts += 1
            if is_permanent(exc) or (self._attempts >= self.max_attempts and healthy(self._health)):
                self._attempts = 0
                self._rejected += 1
                with self._cv:
                    self.spool.reject(op, exc)
                if self._rejected <= 3:
                    log.warning("trackdiag: MLflow rejected a %r batch (%s: %s); kept in %s/rejected.jsonl",
                                name, type(exc).__name__, str(exc)[:300], self.spool.dir)
                return True
        with self._cv:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("trackdiag: MLflow at %s unreachable (%s: %s). Training continues; diagnostics are "
                            "spooled in %s and retried with backoff (one warning per outage)",
                            self.state["tracking_uri"], type(exc).__name__, str(exc)[:200], self.spool.dir)
            self._delay = min(max(self._delay * 2, self.backoff), self.max_backoff)
            self._retry_at = time.monotonic() + self._delay
            self._cv.notify_all()
        return False

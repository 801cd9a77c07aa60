"""The MLflow sink's delivery thread: sends ops in merged groups, spools them to disk during outages.

The sink thread only calls :meth:`Deliverer.submit` (a deque append) so a slow or dead tracking
server never holds up the other sinks, let alone training. The thread takes everything queued
(after a short linger, so a fast loop's records share calls) and hands it to the runner as groups
(``_mlflow_batch.group_end``) that become a few ``log_batch`` calls and one upload. When a call
fails like an outage (connection refused, 5xx, timeouts) the deliverer warns once, moves
everything pending to the :class:`Spool`, and retries with exponential backoff (a ``/health``
probe first for servers); when the server answers again it delivers the spool oldest first.
Ops MLflow rejects for good (bad value, missing file) are isolated op by op and kept in
``rejected.jsonl``. :meth:`close` persists what is pending (the ``end`` op with it) and then waits
as long as delivery moves (see its doc).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

from trackdiag.sinks.mlflow.batch import GROUP_POINTS, group_end, group_summary
from trackdiag.sinks.mlflow.close import CloseWait
from trackdiag.sinks.mlflow.ops import op_size
from trackdiag.sinks.mlflow.outage import Outages
from trackdiag.sinks.mlflow.run import Runner
from trackdiag.sinks.mlflow.spool import Spool
from trackdiag.sinks.mlflow.store import health_url, healthy

log = logging.getLogger("trackdiag")

LINGER = 2.0  # seconds the thread lets ops accumulate before a call while training runs


class Deliverer(CloseWait, Outages):
    """One daemon thread applying ops to MLflow. ``state`` is the run state (see ``Runner``);
    ``on_open`` runs (on this thread) once the run exists in the store."""

    def __init__(self, spool: Spool, state: dict[str, Any], *, backoff: float = 1.0, max_backoff: float = 30.0,
                 max_memory_ops: int = 64, max_attempts: int = 5, linger: float = LINGER,
                 runner_factory: Callable[[dict[str, Any]], Any] = Runner,
                 on_open: Callable[[], None] | None = None) -> None:
        self.spool, self.state, self._factory, self._on_open = spool, state, runner_factory, on_open
        self.backoff, self.max_backoff, self.linger = backoff, max_backoff, linger
        self.max_memory_ops, self.max_attempts = max_memory_ops, max_attempts
        self._cv = threading.Condition()
        self._mem: collections.deque[tuple[int, dict[str, Any]]] = collections.deque()
        self._mem_since = 0.0          # monotonic time the queue last went from empty to non-empty
        self._seq = 0
        self._inflight: list[Any] | None = None   # [seq, ops, persisted?] taken from the queue
        self._runner: Any = None  # Runner, or ProcessRunner (same interface, in a child process)
        self._worker_pid: int | None = None  # a ProcessRunner's worker, from its start (CloseWait.spawned)
        self._health = health_url(state["tracking_uri"])
        self._retry_at = 0.0           # monotonic time of the next try while down
        self._delay = 0.0              # current backoff (0 = up)
        self._down_since: float | None = None
        self._attempts = 0
        self._rejected = 0
        self._broken: str | None = None
        self._stop = self._closing = False
        self.done = [0, 0]             # metric points and files delivered (for progress at close)
        self._thread = threading.Thread(target=self._loop, name="trackdiag-mlflow", daemon=True)

    # ------------------------------------------------------------------ sink-thread API
    def start(self) -> None:
        self._thread.start()

    def submit(self, ops: list[dict[str, Any]]) -> None:
        """Queue ops (O(1) each). Beyond ``max_memory_ops`` pending they go to the disk spool."""
        with self._cv:
            if not self._mem:
                self._mem_since = time.monotonic()
            for op in ops:
                self._mem.append((self._seq, op))
                self._seq += 1
            if len(self._mem) > self.max_memory_ops:
                self._spill()
            self._cv.notify_all()

    @property
    def broken(self) -> str | None:
        """Why delivery stopped for good (the run could not be set up), else None."""
        return self._broken

    # ------------------------------------------------------------------ delivery thread
    def _idle(self) -> bool:
        return not self._mem and self._inflight is None and not self.spool.segments()

    def _spill(self) -> None:
        """Move every queued op to one new segment (lock held)."""
        if self._mem:
            self.spool.write(self._mem[0][0], [op for _, op in self._mem], self.state)
            self._mem.clear()

    def _persist(self) -> None:
        """Put everything pending on disk (lock held): the group in flight and the queue."""
        if self._inflight is not None and not self._inflight[2]:
            self.spool.write(self._inflight[0], self._inflight[1], self.state)
            self._inflight[2] = True
        self._spill()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    now = time.monotonic()
                    if self._broken is not None or now < self._retry_at:
                        self._spill()  # cannot deliver now: keep memory bounded, nothing lost
                        self._cv.wait(None if self._broken is not None else self._retry_at - now)
                        continue
                    if self.spool.segments():
                        break
                    if self._mem:
                        wait = self._mem_since + self.linger - now
                        if self._closing or wait <= 0 or self._runner is None or self._queued_points() >= GROUP_POINTS:
                            break
                        self._cv.wait(wait)  # let a fast loop's records share one call
                        continue
                    self._cv.notify_all()  # idle: close() may be waiting
                    self._cv.wait()
            try:
                self._round()
            except Exception as exc:  # never let the thread die: treat as an outage
                self._classify([{"op": "?"}], exc)

    def _queued_points(self) -> int:
        return sum(op_size(op) for _, op in self._mem if op.get("op") == "points")

    def _round(self) -> None:
        """Deliver the spool (oldest first), then the queue, until empty or a failure."""
        if (self._runner is None or self._down_since is not None) and not healthy(self._health):
            self._classify([{"op": "health"}], ConnectionError(f"no answer from {self._health}"))
            return  # servers: a /health probe before MLflow's own long retries
        if self._runner is not None and getattr(self._runner, "dead", False):
            self._runner = None  # the worker process died: start a new one
        if self._runner is None:
            try:
                runner = self._factory(self.state)
            except Exception as exc:
                self._classify([{"op": "connect"}], exc)
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
                if len(segs) > 1:
                    self.spool.compact(self.state)  # one segment per failed try: merge them into few calls
                    segs = self.spool.segments()
                if segs:
                    seg, ops = segs[0], Spool.load(segs[0])
                elif self._mem:
                    end = group_end([op for _, op in self._mem])
                    taken = [self._mem.popleft() for _ in range(end)]
                    self._inflight = [taken[0][0], [op for _, op in taken], False]
                    self._mem_since = time.monotonic()
                else:
                    return
            if segs:
                if not self._segment(seg, ops):
                    return
                continue
            seq, ops, _ = self._inflight  # type: ignore[misc]
            done = self._deliver(ops)
            with self._cv:
                if self._stop:
                    return
                persisted = self._inflight[2]  # type: ignore[index]
                self._inflight = None
                if done < len(ops) or persisted:  # close() may have put it on disk meanwhile
                    self.spool.write(seq, ops[done:], self.state)
                if done < len(ops):
                    self._spill()
                    return

    def _segment(self, seg: Any, ops: list[dict[str, Any]]) -> bool:
        """Deliver one spool segment group by group, rewriting it after each. False on failure."""
        i = 0
        while i < len(ops):
            j = group_end(ops, i)
            done = self._deliver(ops[i:j])
            with self._cv:
                if self._stop:
                    return False
                i += done
                self.spool.write(Spool.seq_of(seg), ops[i:], self.state)  # the rest, or delete the file
                if i < j:
                    return False
        return True

    def _deliver(self, ops: list[dict[str, Any]]) -> int:
        """Send one group; returns how many ops (from the front) are done: delivered, or rejected
        for good. A group MLflow refuses is split in halves until the bad op is alone (a few more
        calls, not one per op); ops whose file is gone are skipped by the runner and rejected."""
        try:
            refused = self._runner.run_many(ops) or {}  # type: ignore[union-attr]
        except Exception as exc:
            if self._classify(ops, exc) != "reject":
                return 0
            if len(ops) == 1:
                self._reject(ops[0], exc)
                return 1
            mid = len(ops) // 2
            done = self._deliver(ops[:mid])
            return done if done < mid or self._stop else mid + self._deliver(ops[mid:])
        for i, why in refused.items():
            self._reject(ops[i], why)
        self._delivered(ops)
        return len(ops)

    def _delivered(self, ops: list[dict[str, Any]]) -> None:
        entities, files = group_summary(ops)
        with self._cv:
            self.done[0] += entities
            self.done[1] += files
            if ops[0]["op"] == "open" and self.spool.exists():
                self.spool.write_meta(self.state)
            self._cv.notify_all()
        self._attempts = 0
        if self._down_since is not None:
            log.info("trackdiag: MLflow at %s is back after %.0fs; delivering what was spooled",
                     self.state["tracking_uri"], time.monotonic() - self._down_since)
            self._down_since, self._delay = None, 0.0
        if ops[0]["op"] == "open" and self._on_open is not None:
            callback, self._on_open = self._on_open, None
            try:
                callback()
            except Exception as exc:  # e.g. leftover spools could not be looked at: not our run's problem
                log.debug("trackdiag: after-open callback failed: %s", exc)

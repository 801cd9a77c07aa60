"""How the MLflow delivery worker gives the CPU to training first.

The worker's CPU is a few seconds a run (importing MLflow ~2.4 CPU-s, making the store and the run, writing batches),
most of it at the start. On a machine whose cores torch's intra-op threads occupy (torch's default: one per core), a
worker that takes a core when a parallel region starts holds every thread of that region at its barrier until the
scheduler switches back: the README example's first ~250 steps ran 10-30x slower (600 steps: 4.3 s against 1.05 with
the local record only, 2 cores, ``benchmarks/tracker_startup.py``). With one torch thread the worker cost nothing.

The worker runs in a session of its own (a terminal's Ctrl-C must not reach it), and on Linux a new session is a new
scheduling *autogroup*: groups share the CPU by their own weight, so ``nice`` inside the worker's group weighs nothing
against training's (its earlier ``os.nice(5)`` changed nothing there). Its group's nice is set instead
(``/proc/self/autogroup``; any value >= 0 is allowed without privileges, so it can be set back down):

- ``START`` (19) from the worker's first line until its run exists (the import, the store): it runs in the gaps
  training leaves; on 2 cores that run took 1.4 s instead of 4.3 (600 steps), 7 instead of 12-15 s (5,000 steps),
  and the run existed ~9 s after the start instead of ~2.5;
- ``STEADY`` (10) from then on, or after ``STARVED`` seconds without a run (a CPU that training saturates leaves no
  gaps): ~10 % of the CPU against a training process at 0, enough to deliver as training logs;
- ``HURRY`` (0) once the session closes (set by the training process, :func:`hurry`: the worker is its child, same
  user), whether or not the worker has its run yet: training is over, what is left to deliver is what the user waits
  for (on a machine whose cores other work keeps busy, a worker at 10 or 19 took 30-40 s to deliver what it does in a
  few at 0, and the session gave up on it); back to ``STEADY`` when a kept worker serves the next session
  (:meth:`Yielding.resume`, in the worker). A worker whose run comes only after the hurry stays at 0. A worker whose
  training process died without a goodbye (killed) hurries itself (:meth:`Yielding.hurry`) before it ends the run
  KILLED: a sweep or a user is waiting to see it ended, and at 10 it would share busy cores at a tenth of their
  weight.

Where there are no autogroups (autogroup off, a cgroup of its own, not Linux) the worker's own ``nice`` does the same
job; it cannot be lowered again without privileges, so it is set once, to ``STEADY``.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

START, STEADY, HURRY, STARVED = 19, 10, 0, 30.0
AUTOGROUP = Path("/proc/self/autogroup")


def autogroup_nice(path: Path = AUTOGROUP) -> int | None:
    """The nice value of this process's autogroup (``/autogroup-123 nice 19``), or None without one."""
    try:
        return int(path.read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def set_group(pid: int, nice: int, tries: int = 1) -> bool:
    """Set the autogroup nice of process ``pid`` (the delivery worker, from the training process); False without
    autogroups or when the kernel refuses. One try by default: the training process never waits on it."""
    path = Path(f"/proc/{pid}/autogroup")
    return autogroup_nice(path) is not None and _set_autogroup(nice, path, tries)


def hurry(pid: int, wait: float = 5.0) -> None:
    """The session is closing: worker ``pid``'s group to ``HURRY``. On a thread of its own, so close never waits on
    it; best effort. A worker spawned a moment ago has not set its ``START`` yet (its first line) and would undo an
    earlier change: the thread waits up to ``wait`` seconds for the group to leave its default (0) first, and retries
    past the kernel's one autogroup change per 100 ms (machine-wide: other workers starting)."""
    def run() -> None:
        path = Path(f"/proc/{pid}/autogroup")
        end = time.monotonic() + wait
        while autogroup_nice(path) == 0 and time.monotonic() < end:
            time.sleep(0.05)
        set_group(pid, HURRY, 4)

    threading.Thread(target=run, daemon=True, name="trackdiag-mlflow-hurry").start()


def _set_autogroup(nice: int, path: Path, tries: int = 3) -> bool:
    for _ in range(tries):  # the kernel refuses (EAGAIN) a second change within 100 ms, machine-wide
        try:
            path.write_text(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                return False
            time.sleep(0.12)
    return False


class Yielding:
    """The worker's priority: :meth:`start` at its first line, :meth:`settle` once its run exists (idempotent)."""

    def __init__(self, path: Path = AUTOGROUP, own_nice: bool = True) -> None:
        self._path, self._own_nice = path, own_nice
        self._grouped = False
        self._settled = threading.Event()

    def start(self) -> None:
        if self._own_nice and hasattr(os, "nice"):
            try:
                os.nice(STEADY)
            except OSError:
                pass
        self._grouped = autogroup_nice(self._path) is not None and _set_autogroup(START, self._path)
        if self._grouped:
            threading.Thread(target=self._starved, daemon=True, name="trackdiag-mlflow-priority").start()

    def _starved(self) -> None:
        if not self._settled.wait(STARVED):
            self.settle()

    def resume(self) -> None:
        """A kept worker serves a new session: its steady share again (the last session's close hurried it)."""
        if self._grouped and self._settled.is_set():
            _set_autogroup(STEADY, self._path)

    def hurry(self) -> None:
        """The training process is gone: what is left (ending its run) is what someone waits for."""
        self._settled.set()
        if self._grouped:
            _set_autogroup(HURRY, self._path)

    def settle(self) -> None:
        if self._settled.is_set():
            return
        self._settled.set()
        if self._grouped and autogroup_nice(self._path) == START:  # not when the session's close hurried it already
            _set_autogroup(STEADY, self._path)

"""The MLflow worker's pipe: length-prefixed pickles both ways, and the workers kept between sessions.

A worker whose session closed cleanly is kept for the next session of the same process and environment
(:func:`park`, :func:`take`): the jobs of a joblib or Optuna sweep (each in its own directory under Hydra's
``hydra.job.chdir=True``), several runs in a notebook; each session tells the worker its working directory.
Its run is released first (the worker holds none while kept), so a parent that dies then leaves
nothing to end KILLED; at exit the kept workers get a goodbye (:func:`close_parked`).
"""
from __future__ import annotations

import atexit
import os
import pickle
import struct
import subprocess
import threading
from typing import IO, Any


def send(stream: IO[bytes], msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def receive(stream: IO[bytes]) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError("pipe closed")
    (size,) = struct.unpack("<I", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("pipe closed mid-message")
    return pickle.loads(data)


_pool_lock = threading.Lock()
_parked: dict[tuple[Any, ...], "subprocess.Popen[bytes]"] = {}  # at most one
_registered: list[Any] = []


#: variables that change between the sessions of one process and that no MLflow call of the worker reads: pytest
#: names the test running in ``PYTEST_CURRENT_TEST`` (setup, call, teardown of each), so a user's tests of their
#: training loop got a worker each (~2 s of CPU importing MLflow) instead of sharing one; MLflow's telemetry puts its
#: session id in ``_MLFLOW_TELEMETRY_SESSION_ID`` when the user's process first imports MLflow (an ``MlflowClient``
#: to read a run back), so the next session got a worker of its own; a kept worker's telemetry keeps the id it
#: started with, which no logging call reads
_NOT_KEYED = frozenset({"PYTEST_CURRENT_TEST", "_MLFLOW_TELEMETRY_SESSION_ID"})


def pool_key(env: dict[str, str]) -> tuple[Any, ...]:
    """Which sessions may share a worker: the same process (a forked child never takes its parent's) and
    the same environment (MLflow's credentials and settings are read from it), but for the variables in
    ``_NOT_KEYED``. Not the directory: every path the sink sends is absolute, and the worker moves to
    each session's working directory (``ProcessRunner``), so whatever MLflow resolves against it resolves as in
    a worker started there."""
    return os.getpid(), tuple(sorted(kv for kv in env.items() if kv[0] not in _NOT_KEYED))


def take(key: tuple[Any, ...]) -> "subprocess.Popen[bytes] | None":
    with _pool_lock:
        proc = _parked.pop(key, None)
    return proc if proc is not None and proc.poll() is None else None


def park(key: tuple[Any, ...], proc: "subprocess.Popen[bytes]") -> bool:
    """Release the worker's run and keep it for the next session with ``key``; False (the caller ends
    it) when it is gone, does not answer the release, or a worker is kept for ``key`` already. One
    worker is kept per process: one kept for another key is sent away (a test suite or a notebook that
    changes directory or environment between sessions would otherwise pile up idle workers)."""
    with _pool_lock:
        if key in _parked or proc.poll() is not None or key[0] != os.getpid():
            return False
        try:
            send(proc.stdin, {"release": True})  # type: ignore[arg-type]
            if receive(proc.stdout).get("released") is not True:  # type: ignore[arg-type]
                return False
        except (OSError, ValueError, EOFError):
            return False
        if not _registered:
            _registered.append(atexit.register(close_parked))
        evicted = list(_parked.values())
        _parked.clear()
        _parked[key] = proc
    for old in evicted:
        _bye(old)
    return True


def close_parked() -> None:
    """At exit: say goodbye to this process's kept worker (it exits on EOF; nobody waits)."""
    with _pool_lock:
        procs = [_parked.pop(k) for k in [k for k in _parked if k[0] == os.getpid()]]
    for proc in procs:
        _bye(proc)


def _bye(proc: "subprocess.Popen[bytes]") -> None:
    try:
        send(proc.stdin, {"bye": True})  # type: ignore[arg-type]
        proc.stdin.close()  # type: ignore[union-attr]
    except (OSError, ValueError):
        pass

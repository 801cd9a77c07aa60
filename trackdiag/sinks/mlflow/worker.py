"""MLflow calls in a child process, so their Python work never competes with training for the GIL.

With a local SQLite store, ``log_batch`` of 1000 metrics is ~0.15-0.3 s of SQLAlchemy work;
run on a thread of the training process it slows a Python-bound training loop by about that
much per logged step. :class:`ProcessRunner` has the :class:`~trackdiag.sinks.mlflow.run.Runner`
interface but forwards each group of ops as a length-prefixed pickle to ``python -m
trackdiag.sinks.mlflow.worker`` and reads the reply the same way: the parent pays a
``pickle.dumps`` (~0.05 ms per 1000 points) and a pipe write per group. Only this package's two
ends speak the protocol. The child starts through :func:`child_command` (trackdiag's modules
without its package ``__init__``, so no torch import), in a session of its own and ignoring SIGINT:
a terminal's Ctrl-C (SIGINT to the whole foreground process group) stops training, never the
delivery of what training logged; the worker finishes when the session closes its stdin, or
exits when its parent dies. A parent that dies without saying goodbye (``{"bye": true}``, sent by
:meth:`ProcessRunner.close`) was killed (SIGKILL, the OOM killer): the child then ends the run
KILLED (``Runner.abandon``) before it exits, so a killed job's run does not stay RUNNING on the
server. Its own logs (and MLflow's prints) go to stderr; MLflow's own "View run at" line is
switched off (trackdiag prints the run's link in the model-training view). It gives the CPU to training
first (:mod:`trackdiag.sinks.mlflow.priority`): its scheduling group at nice 19 until its run exists, 10 after,
0 once the session closes (what is left is what the user waits for).

A worker whose session closed cleanly is kept for the next session of the same process and environment
(:mod:`trackdiag.sinks.mlflow.pipe`), which it serves from that session's working directory: importing MLflow (~2 s of CPU) is paid once per process
instead of once per run. A new SQLite store is a copy of an empty one (:mod:`trackdiag.sinks.mlflow.new_store`).
"""
from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trackdiag.sinks.mlflow.ops import is_permanent
from trackdiag.sinks.mlflow.pipe import park, pool_key, receive, send, take
from trackdiag.sinks.mlflow.priority import Yielding
from trackdiag.sinks.mlflow.run import NoRun


class WorkerError(RuntimeError):
    """An error raised in the worker process; ``permanent`` and ``error_code`` as classified there."""

    def __init__(self, message: str, permanent: bool, error_code: str | None) -> None:
        super().__init__(message)
        self.permanent, self.error_code = permanent, error_code


class ProcessRunner:
    """Executes ops in a child process. Raises ``ConnectionError`` if the child is gone."""

    def __init__(self, state: dict[str, Any], on_spawn: Callable[[int], None] | None = None) -> None:
        """``on_spawn``: told the worker's pid as soon as it runs, before it has answered (a session closing meanwhile
        hurries it: :func:`~trackdiag.sinks.mlflow.priority.hurry`); a kept worker's once it serves this session."""
        self.state = state
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[3])  # the child imports this same trackdiag
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        # MLflow's own HTTP retries default to ~4 min per call; the deliverer has its own backoff and
        # spool, so fail fast here (unless the user tuned these for their server).
        env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        env.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
        env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
        # trackdiag prints the run's link itself, in the UI's model-training view (``_mlflow_note``)
        env.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.calls = 0  # MLflow calls the worker made so far
        self._lock = threading.Lock()  # held while a request is in flight: only an idle worker is parked
        self._key = pool_key(env)
        parked = take(self._key)
        if parked is not None:
            self._proc = parked
            try:
                self._call({"init": state, "cwd": os.getcwd()})  # where the session's relative paths start
                if on_spawn is not None:  # after the init: that puts a kept worker back to its steady share
                    on_spawn(parked.pid)
                return
            except ConnectionError:  # it died while parked: start a fresh one
                pass
        # its own session: a terminal's Ctrl-C reaches the training process only (see the module doc)
        self._proc = subprocess.Popen(child_command("trackdiag.sinks.mlflow.worker"), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env, start_new_session=True)
        if on_spawn is not None:  # the init waits for MLflow's import: seconds on a busy machine
            on_spawn(self._proc.pid)
        self._call({"init": state, "cwd": os.getcwd()})

    @property
    def dead(self) -> bool:
        return self._proc.poll() is not None

    def run(self, op: dict[str, Any]) -> None:
        if self._call({"ops": [op]}):
            raise FileNotFoundError(f"artifact {op.get('path')} no longer exists")

    def run_many(self, ops: list[dict[str, Any]]) -> dict[int, str]:
        """One round trip for a whole group (see ``Runner.run_many``); the ops skipped."""
        return self._call({"ops": ops})

    def _call(self, msg: dict[str, Any]) -> dict[int, str]:
        try:
            with self._lock:
                send(self._proc.stdin, msg)  # type: ignore[arg-type]
                reply = receive(self._proc.stdout)  # type: ignore[arg-type]
        except (OSError, ValueError, EOFError) as exc:
            raise ConnectionError(f"MLflow worker process gone ({type(exc).__name__}: {exc}; "
                                  f"exit code {self._proc.poll()})") from None
        self.state.update(reply.get("state") or {})
        self.calls = int(reply.get("calls") or 0)
        if "error" in reply:
            if reply.get("no_run"):
                raise NoRun(reply["error"])
            raise WorkerError(reply["error"], bool(reply.get("permanent")), reply.get("error_code"))
        return dict(reply.get("refused") or {})

    def close(self, wait: float = 0.0) -> None:
        """Park the child for the next session (:func:`pipe.park`) when it is idle and alive; else end it:
        close its stdin (it exits on EOF: MLflow's own shutdown takes ~1 s, nobody waits for that); with
        ``wait``, kill it if it has not exited after that many seconds."""
        if not wait and self._lock.acquire(blocking=False):  # no request in flight
            try:
                if park(self._key, self._proc):
                    return
            finally:
                self._lock.release()
        try:
            send(self._proc.stdin, {"bye": True})  # type: ignore[arg-type]  # a goodbye: not killed
        except (OSError, ValueError):
            pass
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        if wait:
            try:
                self._proc.wait(wait)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)


_BOOT = ("import importlib, sys, types; pkg = types.ModuleType('trackdiag'); pkg.__path__ = [sys.argv[1]]; "
         "sys.modules['trackdiag'] = pkg; sys.argv = sys.argv[2:]; importlib.import_module(sys.argv[0]).main()")


def child_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module.main()`` of this very trackdiag (the parent's package directory,
    whatever the child's ``sys.path`` finds first) in a child Python, without executing
    ``trackdiag/__init__.py`` (it no longer imports torch, which a delivery child never needs, but it
    registers the Optuna watcher and loads the package's face)."""
    package = Path(__file__).resolve().parents[2]  # trackdiag/sinks/mlflow/worker.py -> trackdiag/
    return [sys.executable, "-c", _BOOT, str(package), module, *args]


_abandon_lock = threading.Lock()
_abandoned: list[bool] = []
_priority: list[Yielding] = []


def _abandon(runner: Any) -> None:
    """The parent died without a goodbye: end its run KILLED (once; best effort, one line on failure), hurried."""
    with _abandon_lock:
        if _abandoned or runner is None:
            return
        _abandoned.append(True)
        for priority in _priority:
            priority.hurry()
        try:
            if runner.abandon():
                logging.getLogger("trackdiag").warning(
                    "trackdiag: the training process died without ending MLflow run %s; ended it KILLED",
                    runner.state.get("run_id"))
        except Exception as exc:  # the store does not answer: the sweep's end (or sync) does it later
            logging.getLogger("trackdiag").warning("trackdiag: could not end the killed run: %s", exc)


def _watch_parent(ppid: int, holder: list[Any]) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:  # orphaned: the training process is gone (forked children may keep stdin open)
            _abandon(holder[0] if holder else None)
            os._exit(0)


def main() -> None:
    """The worker loop: one request per framed message on stdin, one reply on stdout. SIGINT is
    ignored (a Ctrl-C meant for training, e.g. ``kill -INT -<pgid>``): the parent ends the worker by
    closing its stdin once delivery is done.

    On the way out the heap is frozen: Python's final garbage collections over MLflow's and
    SQLAlchemy's objects took ~1 s here (~3 s on a busy 2-core machine), and the worker writes to
    the training process's stderr, so anything reading that to its end (``python train.py | tee
    log``, a CI job capturing output) waited that long after training had exited. Objects are
    still freed by reference count; every call was answered before this point."""
    try:
        _serve()
    finally:
        gc.freeze()


def _serve() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    priority = Yielding()
    _priority[:] = [priority]
    priority.start()  # before importing MLflow: the import is most of what a run costs here
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # MLflow prints ("View run at ...") must not corrupt the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # outages: the parent warns once, not per retry
    ppid = os.getppid()
    holder: list[Any] = []
    threading.Thread(target=_watch_parent, args=(ppid, holder), daemon=True).start()
    from trackdiag.sinks.mlflow.run import Runner

    runner: Runner | None = None
    while True:
        try:
            msg = receive(sys.stdin.buffer)
        except EOFError:  # no goodbye: the parent died (a parent alive here closed us without one: not killed)
            time.sleep(0.2)
            if os.getppid() != ppid:
                _abandon(runner)
            return
        if msg.get("bye"):
            return
        if msg.get("release"):  # the session closed: kept for the next one, holding no run
            runner = None
            holder[:] = []
            send(proto, {"released": True})
            continue
        if os.getppid() != ppid:  # the parent died with requests still in the pipe: make no new run for it
            _abandon(runner)
            return
        try:
            if "init" in msg:
                if msg.get("cwd"):  # a kept worker serves the next session from its directory, as a new one would
                    os.chdir(msg["cwd"])
                priority.resume()  # a kept worker, hurried at the last close: a steady share while training
                runner = Runner(msg["init"])
                holder[:] = [runner]
            elif runner is None:
                raise NoRun("worker not initialised")
            refused = runner.run_many(msg["ops"]) if "ops" in msg else {}
            reply: dict[str, Any] = {"state": runner.state if runner else {}, "calls": runner.calls if runner else 0,
                                     "refused": refused}
            if runner is not None and runner.state.get("run_id"):
                priority.settle()  # set up: from now on a steady share, enough to deliver as training logs
        except Exception as exc:
            code = getattr(exc, "error_code", None)
            reply = {"error": f"{type(exc).__name__}: {exc}"[:4000], "permanent": is_permanent(exc),
                     "no_run": isinstance(exc, NoRun), "error_code": code if isinstance(code, str) else None,
                     "state": runner.state if runner else {}, "calls": runner.calls if runner else 0}
        try:
            send(proto, reply)
        except OSError:  # the parent is gone mid-request (killed): nobody reads the reply
            time.sleep(0.2)
            if os.getppid() != ppid:
                _abandon(runner)
            return


if __name__ == "__main__":
    main()

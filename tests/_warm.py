"""Python subprocesses for the tests, forked from a warm interpreter instead of started cold (issue 47: the suite's
time). A fresh ``python train.py`` spends ~3 CPU-s importing torch, Dynamo and Hydra before its first line runs,
and the suite starts ~150 of them; ``run`` and ``Popen`` take the same arguments as ``subprocess``'s and give the
same results, but fork the child from a zygote (``tests/_warm_zygote.py``, one per pytest worker and import-time
environment) that has imported those once. The child is still a process of its own: its own ``__main__``,
``sys.argv``, ``sys.path``, working directory, environment, standard streams, exit status and, with
``start_new_session``, session; trackdiag, MLflow and W&B are imported by the child itself, as in a user's run.

Started cold as before, by ``subprocess``: a command that is not ``sys.executable`` running a script, ``-m`` or
``-c``; an environment whose import-time variables (anything but the MLflow, W&B, trackdiag, pytest and
``PYTHONPATH`` ones) differ from the zygote's gets a zygote of its own. ``TRACKDIAG_TEST_COLD=1`` starts every child
cold (to check that a test does not depend on the warm start). The README's commands, the Ctrl-C tests (a terminal's
process group) and the tests of start-up itself start cold on purpose.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ZYGOTE = str(Path(__file__).with_name("_warm_zygote.py"))
#: the zygote's code runs in a namespace of its own: ``__main__`` is the child's to give to its script
BOOT = ("import sys; f = sys.argv.pop(1); exec(compile(open(f).read(), f, 'exec'), "
        "{'__name__': '_warm_zygote', '__file__': f})")
#: environment variables that are read after start-up only (by the child's own imports), so they may differ
#: between the zygote and its children
PER_CHILD = ("MLFLOW_", "WANDB_", "TRACKDIAG_", "PYTEST_", "HYDRA_", "PYTHONPATH", "COV_", "RAY_", "SUBMITIT_",
             "GIT_", "PGDATA", "PGPORT", "NO_PROXY", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
             "https_proxy", "OPTUNA_", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK",
             "LOCAL_WORLD_SIZE", "TORCHINDUCTOR_CACHE_DIR", "TD_", "API_KEY", "COLUMNS", "LINES", "PWD", "OLDPWD", "_")
COLD = os.environ.get("TRACKDIAG_TEST_COLD") == "1"
#: CPU seconds of the children that ended (conftest adds them to a test's CPU: the zygote, not this process,
#: waits for them)
children_cpu = 0.0
_lock = threading.Lock()
_zygotes: dict[tuple, tuple[subprocess.Popen, str]] = {}


def _import_time_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(PER_CHILD)))


def _zygote(env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """The zygote started with ``env``'s import-time variables (started on first use) and its socket."""
    key = _import_time_env(env)
    with _lock:
        known = _zygotes.get(key)
        if known is not None and known[0].poll() is None:
            return known
        # a short directory: a Unix socket's path holds at most ~107 bytes (a long TMPDIR would not fit)
        home = tempfile.mkdtemp(prefix="warm-", dir="/tmp" if os.path.isdir("/tmp") else None)
        path = os.path.join(home, "sock")
        zenv = dict(key)
        if "TRACKDIAG_CENSUS" in env:  # the census line (scripts/suite_cpu.sh) of each child
            zenv["TRACKDIAG_CENSUS"] = env["TRACKDIAG_CENSUS"]
        proc = subprocess.Popen([sys.executable, "-c", BOOT, ZYGOTE, path], env=zenv, cwd=home,
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        _zygotes[key] = (proc, path)
        return proc, path


def _stop_all() -> None:
    for proc, path in _zygotes.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


atexit.register(_stop_all)


def warmable(args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``subprocess.run(args, **kwargs)`` (or ``Popen``) can be forked warm: ``sys.executable`` running a
    script, ``-m`` or ``-c``, with no argument the fork cannot honour (``preexec_fn``, ``shell``, ...)."""
    if COLD or isinstance(args, (str, bytes)) or not args or str(args[0]) != sys.executable or len(args) < 2:
        return False
    unsupported = set(kwargs) - {"cwd", "env", "stdin", "stdout", "stderr", "text", "start_new_session",
                                 "capture_output", "timeout", "check", "input", "universal_newlines", "encoding"}
    if unsupported or kwargs.get("encoding") not in (None, "utf-8"):
        return False
    first = str(args[1])
    return len(args) >= 3 if first in ("-c", "-m") else not first.startswith("-")


class Popen:
    """The subset of ``subprocess.Popen`` the tests use, for a child forked from the zygote."""

    def __init__(self, args: list[Any], *, cwd: Any = None, env: dict[str, str] | None = None, stdin: Any = None,
                 stdout: Any = None, stderr: Any = None, text: bool = False, universal_newlines: bool = False,
                 encoding: str | None = None, start_new_session: bool = False) -> None:
        self.args, self.returncode, self.cpu = args, None, 0.0
        text = bool(text or universal_newlines or encoding)
        env = dict(os.environ if env is None else env)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        zygote, path = _zygote(env)
        deadline = time.monotonic() + 300  # a zygote just started imports for ~3 CPU-s: longer on a busy machine
        while True:
            try:
                self._sock.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if zygote.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the warm-start zygote at {path} never listened (exit code {zygote.poll()}; "
                                       "its stderr is the test worker's)") from None
                time.sleep(0.01)
        ours, theirs = [], []

        def end(spec: Any, fd: int, reading: bool) -> int:
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                mine, child = (w, r) if reading else (r, w)
                ours.append((fd, mine))
                theirs.append(child)
                return child
            if spec == subprocess.DEVNULL:
                child = os.open(os.devnull, os.O_RDWR)
                theirs.append(child)
                return child
            if spec == subprocess.STDOUT:
                return -1
            if spec is None:
                return fd
            return spec if isinstance(spec, int) else spec.fileno()

        fds = [end(stdin, 0, True), end(stdout, 1, False), end(stderr, 2, False)]
        if fds[2] == -1:
            fds[2] = fds[1]
        argv = [str(a) for a in args[1:]]
        req = json.dumps({"argv": argv, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(), "env": env,
                          "new_session": start_new_session}).encode()
        socket.send_fds(self._sock, [struct.pack(">I", len(req)) + req], fds)
        for fd in theirs:
            os.close(fd)
        self._buf = b""
        self.pid = int(self._message(None)["pid"])
        self.stdin = self.stdout = self.stderr = None
        for fd, mine in ours:
            mode = ("w" if fd == 0 else "r") + ("" if text else "b")
            f = open(mine, mode, encoding="utf-8" if text else None, buffering=-1 if text or fd else 0)
            setattr(self, ("stdin", "stdout", "stderr")[fd], f)

    def _message(self, timeout: float | None) -> dict[str, Any]:
        """The zygote's next line; ``TimeoutError`` when none came within ``timeout`` (0: do not wait)."""
        while b"\n" not in self._buf:
            self._sock.settimeout(timeout)
            try:
                more = self._sock.recv(4096)
            except (TimeoutError, BlockingIOError, socket.timeout):
                raise TimeoutError from None
            finally:
                self._sock.settimeout(None)
            if not more:
                raise RuntimeError(f"the warm-start zygote went away while child {self.args} ran")
            self._buf += more
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def _status(self, timeout: float | None) -> None:
        global children_cpu
        msg = self._message(timeout)
        self.cpu = float(msg.get("cpu", 0.0))
        children_cpu += self.cpu
        self.returncode = int(msg["code"])
        self._sock.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self._status(0)
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self._status(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode  # type: ignore[return-value]

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:
        outs: dict[str, Any] = {}

        def drain(name: str) -> None:
            stream = getattr(self, name)
            outs[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=drain, args=(n,), daemon=True) for n in ("stdout", "stderr")
                   if getattr(self, n) is not None]
        for t in readers:
            t.start()
        if self.stdin is not None:
            try:
                if input:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
        self.wait(timeout)
        for t in readers:
            t.join(timeout)
        return outs.get("stdout"), outs.get("stderr")

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> "Popen":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in (self.stdout, self.stderr, self.stdin):
            if f is not None:
                f.close()
        self.wait()


def popen(args: Any, **kwargs: Any) -> Any:
    """``subprocess.Popen(args, **kwargs)``, forked warm where it can be (see the module doc)."""
    return Popen(args, **kwargs) if warmable(args, kwargs) else subprocess.Popen(args, **kwargs)


def run(args: Any, *, capture_output: bool = False, timeout: float | None = None, check: bool = False,
        input: Any = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, ...)``, forked warm where it can be (see the module doc)."""
    if not warmable(args, kwargs):
        return subprocess.run(args, capture_output=capture_output, timeout=timeout, check=check, input=input, **kwargs)
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = Popen(args, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    if check and proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, args, out, err)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)

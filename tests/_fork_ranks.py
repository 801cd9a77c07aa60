"""The ranks of a gloo test as forks of one Python: ``python _fork_ranks.py WORKER WORLD ARG...``.

Each rank is still a process of its own with its own process group over loopback TCP, as under
``torchrun``; what is shared is the start-up: this process imports torch, trackdiag and WORKER once
(~3 s of CPU on the 2-core VM, which four fresh interpreters paid four times) and forks WORLD
children, each with ``RANK`` set, calling ``WORKER.main()`` with ``sys.argv = [WORKER, ARG...]``
(the ``fork`` start method of ``torch.multiprocessing``). Nothing runs a torch kernel before the
fork, so no OpenMP pool is inherited. Each rank's output goes to a file and is printed here, rank by
rank, once all have exited; the exit status is the first failing rank's, else 0. Started in a
session of its own, so a caller that times out kills every rank with one ``killpg``.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import sys
import tempfile
import traceback
from pathlib import Path


def _rank(worker: object, rank: int, argv: list[str], log: str) -> None:
    """The child: run the worker as rank ``rank``, then exit as a finished Python would."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ["RANK"] = str(rank)
    sys.argv = argv
    code = 0
    try:
        worker.main()  # type: ignore[attr-defined]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the rank's log
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what the interpreter's exit would run (sessions left open, sinks)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def main() -> None:
    path, world, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    worker = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[path.stem] = worker
    spec.loader.exec_module(worker)  # type: ignore[union-attr]  # imports torch, trackdiag: once
    logs = Path(tempfile.mkdtemp(prefix="ranks-"))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(worker, rank, [str(path), *args], str(logs / f"rank{rank}.log"))
        pids[pid] = rank
    codes = {}
    while pids:
        pid, status = os.wait()
        codes[pids.pop(pid)] = os.waitstatus_to_exitcode(status)
    for rank in range(world):
        print(f"---- rank {rank} (exit {codes[rank]}) ----\n{(logs / f'rank{rank}.log').read_text()}", flush=True)
    bad = [codes[r] for r in range(world) if codes[r]]
    os._exit(abs(bad[0]) if bad else 0)


if __name__ == "__main__":
    main()

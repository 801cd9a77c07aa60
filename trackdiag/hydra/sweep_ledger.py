"""The sweep ledger in ``<sweep>/.trackdiag/``: which jobs started, which ended, how many to expect.

Hydra's parallel launchers run jobs in other processes (joblib's loky workers, submitit's job
processes), each with a pickled copy of the callback, and Hydra skips ``on_multirun_end`` when a
job failed; submitit's launcher even returns (raising) while later jobs still run. So the
callback keeps its state in files, and any process can tell whether the sweep is over:

- ``sweep.json``: the expected number of jobs (the basic sweeper's grid, when it can be computed
  from the overrides) and the launcher's pid and host; ``launcher_done.json`` once the launcher
  returned or exited;
- ``jobs/<num>.start.json`` (pid, host, process start time) and ``jobs/<num>.json`` (the Hydra
  status, written by ``on_job_end``);
- ``finalized.json``: the jobs the last comparison covered.

A started job without an end marker is *dead* when its process is gone (same host), or when the same
process started a later job (a loky worker that moved on): it was killed. Writes are atomic (tmp +
rename); :func:`locked` serialises deciders. Everything here is small file I/O (~1 ms per job).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("trackdiag.compare")

STATE_DIR = ".trackdiag"


def state(sweep: Path) -> Path:
    return sweep / STATE_DIR


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (tmp + rename): concurrent readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str), encoding="utf-8")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """A ledger file as a dict, or None (missing, torn or not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def locked(sweep: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<sweep>/.trackdiag/lock`` (no-op where fcntl is missing)."""
    path = state(sweep) / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        try:
            import fcntl
        except ImportError:
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (``/proc/<pid>/stat``), or None: with
    the pid it names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return None


def me() -> dict[str, Any]:
    """This process: pid, host, start time."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "pstart": process_start(os.getpid()), "time": time.time()}


def alive(who: dict[str, Any]) -> bool | None:
    """Whether the process ``who`` (from :func:`me`) still runs: None when it ran on another host."""
    if who.get("host") != socket.gethostname():
        return None
    pid = who.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    started = process_start(pid)
    return started is None or who.get("pstart") in (None, started)


def start_sweep(sweep: Path, expected: int | None) -> None:
    """The launcher, before any job: forget an earlier multirun's markers; record the job count."""
    st = state(sweep)
    for f in [*st.glob("jobs/*.json"), st / "failed", st / "finalized.json", st / "launcher_done.json"]:
        f.unlink(missing_ok=True)
    write_json(st / "sweep.json", {"expected": expected, "launcher": me()})


def launcher_done(sweep: Path, all_returned: bool) -> None:
    """The launcher returned (``all_returned``: every job's result came back) or is exiting."""
    write_json(state(sweep) / "launcher_done.json", {"all_returned": all_returned, **me()})


def job_started(sweep: Path, num: int) -> None:
    write_json(state(sweep) / "jobs" / f"{num}.start.json", me())


def job_ended(sweep: Path, num: int, marker: dict[str, Any]) -> None:
    write_json(state(sweep) / "jobs" / f"{num}.json", marker)


@dataclass
class Progress:
    """Where a sweep stands. ``dead``: started, no end marker, process gone (killed)."""

    expected: int | None
    started: dict[int, dict[str, Any]] = field(default_factory=dict)
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    launcher_done: dict[str, Any] | None = None
    finalized: list[int] | None = None

    @property
    def over(self) -> bool:
        """Every job has ended or died: with a known count, all of them (or the launcher got every
        result back); without one, the launcher is done and nothing started still runs."""
        if self.running:
            return False
        done = set(self.ended) | set(self.dead)
        if self.launcher_done and self.launcher_done.get("all_returned"):
            return True
        if self.expected is not None:
            return done >= set(range(self.expected)) or bool(self.launcher_done) and done >= set(self.started)
        return bool(self.launcher_done)

    @property
    def covered(self) -> list[int]:
        return sorted(set(self.ended) | set(self.dead))


def progress(sweep: Path) -> Progress:
    """Read the ledger (one small read per job) and classify every started job."""
    st = state(sweep)
    info = read_json(st / "sweep.json") or {}
    exp = info.get("expected")
    p = Progress(expected=exp if isinstance(exp, int) else None, launcher_done=read_json(st / "launcher_done.json"))
    fin = read_json(st / "finalized.json")
    p.finalized = [n for n in fin.get("jobs", []) if isinstance(n, int)] if fin else None
    for f in (st / "jobs").glob("*.json"):
        stem = f.name.split(".")[0]
        if not stem.isdigit() or (data := read_json(f)) is None:
            continue
        (p.started if f.name.endswith(".start.json") else p.ended)[int(stem)] = data
    latest: dict[tuple[Any, Any, Any], float] = {}  # a process's last job start: a loky worker moves on
    for w in p.started.values():
        key = (w.get("host"), w.get("pid"), w.get("pstart"))
        latest[key] = max(latest.get(key, 0.0), float(w.get("time") or 0.0))
    for num, who in sorted(p.started.items()):
        if num in p.ended:
            continue
        later = latest[(who.get("host"), who.get("pid"), who.get("pstart"))] > float(who.get("time") or 0.0)
        if later or alive(who) is False or (p.launcher_done or {}).get("all_returned"):
            p.dead.append(num)
        else:
            p.running.append(num)
    return p


def expected_jobs(config: Any) -> int | None:
    """How many jobs Hydra's basic sweeper will launch for this multirun (the product of its sweep
    lists, over ``hydra.sweeper.params`` and the command line), or None for other sweepers and
    for sweeps the parser cannot expand here (``glob(...)`` needs the config loader)."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        target = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
        if not target.endswith("BasicSweeper"):
            return None
        params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
        args = [f"{k}={v}" for k, v in params.items()]
        args += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))  # type: ignore[arg-type]
        sizes: dict[str, int] = {}
        for o in OverridesParser.create().parse_overrides(args):
            sizes[o.get_key_element()] = len(list(o.sweep_string_iterator())) if o.is_discrete_sweep() else 1
        n = 1
        for size in sizes.values():
            n *= size
        return n
    except Exception as e:  # noqa: BLE001 - unknown: the launcher's end decides instead
        log.debug("trackdiag: job count of the sweep unknown: %s", e)
        return None

"""The MLflow sink's on-disk spool: undelivered ops as JSON lines, with the run state beside them.

Layout of ``<run output dir>/mlflow_spool/``: ``meta.json`` (tracking URI, run id, whether the
run is ours, the sweep parent, the run spec, the writer's pid), ``seg-<seq>.jsonl`` (ops in
submission order; the file name is the sequence number of its first op, so files sort oldest
first), ``rejected.jsonl`` (ops MLflow refused for good, or that failed the checks of
``_mlflow_check``, with the reason) and ``.lock`` (held with ``flock`` by the process that
delivers it: the session that writes it, ``trackdiag sync``, or a later session's background
delivery, so two of them never deliver one spool). Writes are atomic (temp file + rename); a
segment is rewritten only after some of its ops were delivered.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterable

from trackdiag.sinks.mlflow.ops import op_size
from trackdiag.sinks.mlflow.store import try_lock

log = logging.getLogger("trackdiag")


class Spool:
    """Ops waiting for MLflow, on disk. Not thread-safe: callers hold their own lock. With
    ``owner``, the first write takes the spool's lock (held until :meth:`release`)."""

    def __init__(self, directory: Path, owner: bool = False) -> None:
        self.dir = Path(directory)
        self.owner = owner
        self._lock: IO[str] | None = None

    def exists(self) -> bool:
        return (self.dir / "meta.json").is_file()

    def claim(self) -> bool:
        """Take the spool's lock; False if another process holds it (it is delivering this spool)."""
        if self._lock is None:
            self._lock = try_lock(self.dir / ".lock")
        return self._lock is not None

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def write_meta(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.owner and self._lock is None:
            self.claim()
        meta = {"version": 1, "pid": os.getpid(), "updated": time.time(), "state": masked_state(state)}
        _atomic_write(self.dir / "meta.json", json.dumps(meta, indent=2, default=str))

    def read_meta(self) -> dict[str, Any]:
        return json.loads((self.dir / "meta.json").read_text(encoding="utf-8"))

    def segments(self) -> list[Path]:
        """Segment files, oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(self.dir.glob("seg-*.jsonl"))

    def write(self, seq: int, ops: Iterable[dict[str, Any]], state: dict[str, Any]) -> None:
        """Store ``ops`` (first op numbered ``seq``) as one segment, or delete it when empty."""
        ops = list(ops)
        path = self.dir / f"seg-{seq:012d}.jsonl"
        if not ops:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return
        self.write_meta(state)
        _atomic_write(path, "".join(json.dumps(op) + "\n" for op in ops))

    @staticmethod
    def seq_of(segment: Path) -> int:
        return int(segment.stem.split("-", 1)[1])

    @staticmethod
    def load(segment: Path) -> list[dict[str, Any]]:
        with open(segment, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def compact(self, state: dict[str, Any], max_ops: int = 5000) -> None:
        """Merge runs of small segments (an outage writes one per failed try) into segments of up to
        ``max_ops`` ops, so that delivery can merge their ops into few calls. Each merged segment
        replaces its first file, then the others are deleted (a crash in between only repeats ops,
        which MLflow stores once). Costs one read and one write of the spool."""
        segs = self.segments()
        i = 0
        while i < len(segs):
            ops, j = self.load(segs[i]), i + 1
            while j < len(segs) and len(ops) < max_ops:
                ops += self.load(segs[j])
                j += 1
            if j > i + 1:
                self.write(self.seq_of(segs[i]), ops, state)
                for seg in segs[i + 1:j]:
                    seg.unlink(missing_ok=True)
            i = j

    def reject(self, op: Any, exc: BaseException | str) -> None:
        """Keep an op MLflow refused for good (or that failed a check), with the reason."""
        self.dir.mkdir(parents=True, exist_ok=True)
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        with open(self.dir / "rejected.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"error": reason[:2000], "op": op}, default=str) + "\n")

    def counts(self) -> tuple[int, int]:
        """(ops, entities) still spooled; entities = metric points, params, tags, files."""
        ops = entities = 0
        for seg in self.segments():
            for op in self.load(seg):
                ops += 1
                entities += op_size(op)
        return ops, entities

    def remove_if_done(self) -> bool:
        """Delete the spool dir when nothing is left in it but metadata. True if deleted."""
        if self.segments() or (self.dir / "rejected.jsonl").exists():
            return False
        self.release()
        shutil.rmtree(self.dir, ignore_errors=True)
        return True

    def set_aside(self) -> Path | None:
        """Move a spool left by an earlier run in this dir to ``<dir>-<n>`` (sync delivers it)."""
        if not self.dir.exists():
            return None
        n = 1
        while (target := self.dir.with_name(f"{self.dir.name}-{n}")).exists():
            n += 1
        self.dir.rename(target)
        return target


def masked_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with the tracking URI's credentials masked: a spool on disk never holds them (the
    deliverer keeps the real URI in memory; ``sync`` gets it from ``--tracking-uri`` or
    ``MLFLOW_TRACKING_URI``)."""
    from trackdiag.util.redact import DEFAULT_POLICY

    uri = state.get("tracking_uri")
    if isinstance(uri, str):
        masked = DEFAULT_POLICY.text(uri)
        if masked != uri:
            return {**state, "tracking_uri": masked}
    return state


def real_uri(stored: str, given: str | None) -> str | None:
    """The usable URI for a spool whose meta names ``stored``: ``given`` (or ``MLFLOW_TRACKING_URI``)
    when it is that store with its credentials (same masked form); ``stored`` itself when it holds
    none; None when the credentials are needed and not known."""
    from trackdiag.util.redact import DEFAULT_POLICY

    for cand in (given, os.environ.get("MLFLOW_TRACKING_URI")):
        if cand and DEFAULT_POLICY.text(cand) == stored:
            return cand
    return None if DEFAULT_POLICY.text(stored) != stored or "redacted" in stored else stored


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def spools_in(run_dir: Path) -> list[Path]:
    """Every MLflow spool of a run dir (``mlflow_spool`` and set-aside ``mlflow_spool-<n>``)."""
    return sorted(p for p in Path(run_dir).glob("mlflow_spool*") if (p / "meta.json").is_file())


def drain(spool: Spool, tracking_uri: str | None = None,
          should_stop: Callable[[], bool] = lambda: False) -> tuple[int, int, str | None, list[str]]:
    """Deliver a spool synchronously: (ops delivered, ops left, error, refusals).

    Every op is checked first (``_mlflow_check``: well-formed, files inside the spool's run dir);
    refused ops go to ``rejected.jsonl`` and are listed in ``refusals``. With ``tracking_uri`` (one
    that differs from the recorded store) the data goes to a new run there, never to the recorded
    store or artifact location. Ops are sent in merged groups; stops at the first outage-like
    error (or when ``should_stop()``) and keeps the rest. Caller holds the spool's lock.
    """
    from trackdiag.sinks.mlflow.batch import group_end
    from trackdiag.sinks.mlflow.check import check_op, check_state
    from trackdiag.sinks.mlflow.run import Runner

    state = spool.read_meta().get("state")
    problem = check_state(state, spool.dir.parent)
    if problem:
        return 0, spool.counts()[0], f"refused: {problem}", [problem]
    same = real_uri(state["tracking_uri"], tracking_uri)
    retarget = bool(tracking_uri) and tracking_uri != same
    if not retarget:
        if same is None:  # the recorded store needs credentials the spool does not keep
            return 0, spool.counts()[0], ("the spool's store needs credentials: pass --tracking-uri (or set "
                                          "MLFLOW_TRACKING_URI) with them"), []
        state = {**state, "tracking_uri": same}
    if retarget:  # a new run in the given store; nothing of the recorded one applies there
        spec = dict(state.get("spec") or {}, artifact_location=None, attach_run_id=None)
        state = {"tracking_uri": tracking_uri, "run_id": None, "spec": spec}
    spool.compact(state)
    runner: Runner | None = None
    done, refusals, run_dir = 0, [], spool.dir.parent
    first = True
    for seg in spool.segments():
        ops: list[dict[str, Any]] = []
        for op in spool.load(seg):
            why = check_op(op, run_dir)
            if why is None and retarget and op.get("op") == "open":
                op = {"op": "open", "spec": dict(op["spec"], artifact_location=None, attach_run_id=None)}
            if why:
                refusals.append(why)
                spool.reject(op, f"refused: {why}")
            else:
                ops.append(op)
        if first and retarget and state.get("spec") and not (ops and ops[0]["op"] == "open"):
            ops.insert(0, {"op": "open", "spec": state["spec"]})
        first = False
        i = 0
        while i < len(ops):
            if should_stop():
                spool.write(spool.seq_of(seg), ops[i:], state)
                return done, spool.counts()[0], "stopped", refusals
            j = group_end(ops, i)
            try:
                runner = runner or Runner(state, resumed=True)
            except Exception as exc:
                spool.write(spool.seq_of(seg), ops[i:], state)
                return done, spool.counts()[0], f"{type(exc).__name__}: {exc}", refusals
            n, error = _send(runner, ops[i:j], spool)
            if error is not None:
                spool.write(spool.seq_of(seg), ops[i + n:], state)
                return done + n, spool.counts()[0], error, refusals
            done += j - i
            if ops[i]["op"] == "open":
                spool.write_meta(state)
            i = j
        seg.unlink()
    spool.write_meta(state)
    return done, 0, None, refusals


def _send(runner: Any, ops: list[dict[str, Any]], spool: Spool) -> tuple[int, str | None]:
    """Send a group; a group MLflow refuses for good is split in halves until the bad op is alone
    (rejected). Returns (ops done from the front, the outage-like error that stopped it or None)."""
    from trackdiag.sinks.mlflow.ops import is_permanent
    from trackdiag.sinks.mlflow.run import NoRun

    try:
        refused = runner.run_many(ops) or {}
    except Exception as exc:
        if isinstance(exc, NoRun) or ops[0]["op"] == "open" or not is_permanent(exc):
            return 0, f"{type(exc).__name__}: {exc}"
        if len(ops) == 1:
            spool.reject(ops[0], exc)
            return 1, None
        mid = len(ops) // 2
        done, error = _send(runner, ops[:mid], spool)
        if error is not None:
            return done, error
        more, error = _send(runner, ops[mid:], spool)
        return mid + more, error
    for k, why in refused.items():
        spool.reject(ops[k], why)
    return len(ops), None

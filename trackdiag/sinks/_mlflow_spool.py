"""The MLflow sink's on-disk spool: undelivered ops as JSON lines, with the run state beside them.

Layout of ``<run output dir>/mlflow_spool/``: ``meta.json`` (tracking URI, run id, whether the
run is ours, the sweep parent, the writer's pid), ``seg-<seq>.jsonl`` (ops in submission order;
the file name is the sequence number of its first op, so files sort oldest first) and
``rejected.jsonl`` (ops MLflow refused for good, with the error). ``trackdiag sync`` replays it.
Writes are atomic (temp file + rename); a segment is rewritten only after its ops were delivered.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from trackdiag.sinks._mlflow_ops import is_permanent, op_size

log = logging.getLogger("trackdiag")


class Spool:
    """Ops waiting for MLflow, on disk. Not thread-safe: callers hold their own lock."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)

    def exists(self) -> bool:
        return (self.dir / "meta.json").is_file()

    def write_meta(self, state: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        meta = {"version": 1, "pid": os.getpid(), "updated": time.time(), "state": state}
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

    def reject(self, op: dict[str, Any], exc: BaseException) -> None:
        """Keep an op MLflow refused for good, with the reason, for the record."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "rejected.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000], "op": op}) + "\n")

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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def spools_in(run_dir: Path) -> list[Path]:
    """Every MLflow spool of a run dir (``mlflow_spool`` and set-aside ``mlflow_spool-<n>``)."""
    return sorted(p for p in Path(run_dir).glob("mlflow_spool*") if (p / "meta.json").is_file())


def drain(spool: Spool, tracking_uri: str | None = None) -> tuple[int, int, str | None]:
    """Deliver a spool synchronously (``trackdiag sync``): (ops delivered, ops left, error).

    Stops at the first outage-like error and keeps the rest; ops MLflow rejects for good go to
    ``rejected.jsonl``. Costs one MLflow call per op.
    """
    from trackdiag.sinks._mlflow_run import NoRun, Runner

    state = spool.read_meta()["state"]
    if tracking_uri:
        state["tracking_uri"] = tracking_uri
    runner = Runner(state)
    done = 0
    for seg in spool.segments():
        ops = spool.load(seg)
        for i, op in enumerate(ops):
            try:
                runner.run(op)
            except Exception as exc:
                if isinstance(exc, NoRun) or op["op"] == "open" or not is_permanent(exc):
                    spool.write(spool.seq_of(seg), ops[i:], state)
                    return done, spool.counts()[0], f"{type(exc).__name__}: {exc}"
                spool.reject(op, exc)
            done += 1
            if op["op"] == "open":
                spool.write_meta(state)
        seg.unlink()
    spool.write_meta(state)
    return done, 0, None

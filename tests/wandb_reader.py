"""Read a W&B 0.31 ``run-<id>.wandb`` transaction log back, for tests (no wandb server, no sync).

Format: a 7-byte header ``<4sHB`` (``:W&B``, 0xBEE1, version 0), then 32 KiB leveldb-log blocks of
chunks ``<IHB`` (crc32 of type byte + data, length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4), each
complete payload a serialized ``wandb_internal_pb2.Record``. A block tail shorter than a chunk
header is zero padding.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = struct.Struct("<4sHB")
CHUNK = struct.Struct("<IHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> Iterator[pb.Record]:
    """Every record of a ``.wandb`` file in order; checks the header and each chunk's crc."""
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a W&B 0.31 log (header {ident!r}, {magic:#x}, {version})")
    pos, parts = HEADER.size, []
    while pos + CHUNK.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK.size:  # zero padding at a block's end
            pos += left
            continue
        crc, length, kind = CHUNK.unpack_from(data, pos)
        if length == 0 and kind == 0:  # preallocated/zero tail
            pos += left
            continue
        body = data[pos + CHUNK.size: pos + CHUNK.size + length]
        if zlib.crc32(body, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: bad crc at offset {pos}")
        pos += CHUNK.size + length
        parts.append(body)
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(b"".join(parts))
            parts = []
            yield rec
        elif kind not in (FIRST, MIDDLE):
            raise ValueError(f"{path}: unknown chunk type {kind} at offset {pos}")


def _items(items: Any) -> dict[str, Any]:
    """Items with ``key`` or a ``nested_key`` path (histograms, min/max summaries) as nested dicts."""
    out: dict[str, Any] = {}
    for item in items:
        path = list(item.nested_key) or [item.key]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = json.loads(item.value_json)
    return out


def _merge(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


@dataclass
class WandbRun:
    """What a run logged: ``history`` rows (key -> decoded value), ``config``, ``summary``
    (last update per key), ``alerts`` (title, text, level, wait_duration ms), ``metrics``
    (define_metric records), ``run`` (id, group, name, project, tags), ``exit_code``."""

    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    alerts: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[pb.MetricRecord] = field(default_factory=list)
    run: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None

    def series(self, key: str, step_key: str = "diag/step") -> list[tuple[int, Any]]:
        """``[(step, value)]`` of ``key`` over the history rows that carry it."""
        return [(row[step_key], row[key]) for row in self.history if key in row]

    def histograms(self) -> list[tuple[str, dict[str, Any]]]:
        """``[(key, {"_type": "histogram", "bins": [...], "values": [...]})]`` in order."""
        return [(k, v) for row in self.history for k, v in row.items()
                if isinstance(v, dict) and v.get("_type") == "histogram"]


def read_run(path: str | Path) -> WandbRun:
    """Decode one ``run-<id>.wandb`` file into a :class:`WandbRun`."""
    out = WandbRun()
    for rec in read_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            out.history.append(_items(rec.history.item))
        elif kind == "config":
            out.config.update(_items(rec.config.update))
        elif kind == "summary":
            _merge(out.summary, _items(rec.summary.update))
        elif kind == "alert":
            a = rec.alert
            out.alerts.append({"title": a.title, "text": a.text, "level": a.level, "wait_duration": a.wait_duration})
        elif kind == "metric":
            out.metrics.append(rec.metric)
        elif kind == "run":
            r = rec.run
            out.run = {"id": r.run_id, "group": r.run_group, "name": r.display_name, "project": r.project,
                       "tags": list(r.tags), "job_type": r.job_type}
            out.config.update(_items(r.config.update))
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out


def find_runs(root: str | Path) -> list[Path]:
    """Every ``run-*.wandb`` file under ``root`` (sorted). For runs of THIS process, use
    :func:`settled_runs`: their files may not be complete yet."""
    return sorted(Path(root).rglob("run-*.wandb"))


def settled_runs(root: str | Path) -> list[Path]:
    """:func:`find_runs` after ``wandb.teardown()``. ``run.finish()`` returns once the exit record is
    handled, but it only *publishes* the stream's close to wandb-core, which writes the rest of the
    transaction log asynchronously: a read right after ``finish()`` can see a file with nothing but
    its header on a loaded machine. Tearing the service down waits for its process to exit, after
    which every log is complete. The next ``wandb.init`` starts a fresh service (~0.5 s)."""
    import wandb

    wandb.teardown()
    return find_runs(root)


# ----------------------------------------------------------------------------- what the W&B tests share
#: wandb.Settings that keep an offline test run lean
LEAN = {"console": "off", "x_disable_stats": True, "x_save_requirements": False}


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never online: offline mode, W&B dirs in tmp, no API key or netrc lookups that matter."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def tiny_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)

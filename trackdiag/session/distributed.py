"""``torch.distributed`` support: rank helpers and the one cross-rank reduction per logging step.

Every rank computes its probes; at a logging step the session hands the host values to
:meth:`DistSync.reduce`, which gathers every per-rank value in ONE ``all_gather`` of a flat float64
vector (preceded by a 16-byte layout handshake, so ranks whose keys differ fall back to a gather of
objects instead of hanging) and reduces it on the host as declared per key. Every rank then publishes
and judges the SAME record, so rules take the same ``stop``/``raise`` decision at the same step.

Reductions (``REDUCE_FX``): ``mean`` (default), ``max``, ``min``, ``sum``, ``norm`` (sqrt of the sum
of squares: shard-local norms under FSDP), ``max_spread`` (max, plus the spread and the per-rank
values), ``same`` (identical on every rank by construction: not gathered at all), ``per_rank`` (every
rank's values, rank after rank: the probe compares them itself, e.g. ``rank_sync``). A probe may declare
``dist_reduce_fx`` (one name, or ``{key glob: name}``), like torchmetrics' ``add_state``.

Gradient/parameter/update statistics are ``same`` under DDP (read after its all-reduce; replicated
weights) and ``norm``/``max``/``sum`` of shard-local values for a component whose parameters are
DTensors (FSDP2 ``fully_shard``).

Emits (rank 0 writes): ``diag/dist/world_size``; ``diag/dist/spread/<name>`` (max - min over ranks)
and table ``diag/dist/per_rank/<name>`` for ``max_spread`` keys (step time, memory, data wait);
table ``diag/dist/nonfinite_rank`` (record key -> the rank whose value went non-finite first).
Cost per logging step: two collectives (16 bytes, then world x the values), a copy to the
collective's device under NCCL; nothing on other steps.
"""
from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from trackdiag.util.ranks import is_distributed, is_sharded, rank, world_size

if TYPE_CHECKING:
    from trackdiag.capture.context import Component
    from trackdiag.core.record import Record

log = logging.getLogger("trackdiag")

REDUCE_FX = ("mean", "max", "min", "sum", "norm", "max_spread", "same", "per_rank")
#: probes whose values are functions of the (replicated, all-reduced) weights and gradients
REPLICATED = frozenset({"grads", "params", "updates", "gradflow"})
#: sharded components: how shard-local values of the replicated probes combine (key glob -> fx)
SHARDED_FX = (("*max_abs", "max"), ("*nonfinite*", "sum"), ("*norm*", "norm"), ("*", "mean"))
#: (probe name glob, key glob, fx); first match wins; anything else: mean
TABLE: tuple[tuple[str, str, str], ...] = (
    ("throughput", "diag/perf/step_time_ms", "max_spread"),
    ("throughput", "diag/perf/samples_per_s", "sum"),
    ("memory", "*_frac*", "max"),
    ("memory", "*", "max_spread"),
    ("data_wait", "diag/data/wait_ms", "max_spread"),
    ("data_wait", "diag/data/wait_share", "max"),
    ("data_wait", "diag/data/batches", "sum"),
    ("data*", "*first*", "min"),
    ("data*", "*count*", "sum"),
    ("data*", "*bad*", "sum"),
    ("data*", "*tensors*", "sum"),
    ("data*", "*max", "max"),
    ("data*", "*min", "min"),
)


def record_key(probe: Any, key: str) -> str:
    """The record key a probe-local key is published under, for ``diag/dist/nonfinite_rank``."""
    if probe.name == "loss":
        return f"diag/{key}/loss" if key else "diag/loss"
    return key if key.startswith("diag/") else f"{probe.name}/{key}"


@dataclass
class Reduced:
    """Cross-rank extras added to the record after the probes published (rank-0 view, same everywhere)."""

    scalars: dict[str, float] = field(default_factory=dict)
    tables: dict[str, dict[str, float]] = field(default_factory=dict)

    def apply(self, record: Record) -> None:
        record.scalars.update(self.scalars)
        for name, table in self.tables.items():
            record.tables.setdefault(name, {}).update(table)


class DistSync:
    """The reduction of one session; built by :meth:`detect` (None outside a multi-rank group)."""

    def __init__(self, components: Sequence[Component]) -> None:
        self.world = world_size()
        self.rank = rank()
        self.sharded = {c.name for c in components if any(is_sharded(p) for p in c.index.params)}
        self._warned: set[str] = set()

    @classmethod
    def detect(cls, components: Sequence[Component]) -> "DistSync | None":
        return cls(components) if is_distributed() else None

    def fx(self, probe: Any, key: str) -> str:
        """The declared reduction of ``key`` from ``probe``."""
        own = getattr(probe, "dist_reduce_fx", None)
        if isinstance(own, str):
            return own
        if isinstance(own, dict):
            for pat, fx in own.items():
                if fnmatch.fnmatchcase(key, pat):
                    return fx
        if probe.name in REPLICATED:
            if key.split("|", 1)[0] not in self.sharded:
                return "same"
            return next(fx for pat, fx in SHARDED_FX if fnmatch.fnmatchcase(key, pat))
        for pname, pat, fx in TABLE:
            if fnmatch.fnmatchcase(probe.name, pname) and fnmatch.fnmatchcase(key, pat):
                return fx
        return "mean"

    def reduce(self, host: dict[str, np.ndarray], probes: Sequence[Any]) -> tuple[dict[str, np.ndarray], Reduced]:
        """Reduce the session's collected host values (keys ``"<probe index>\\t<key>"``) across ranks.

        Collective: every rank must call it at the same logging step. Returns the reduced values
        (``same`` keys untouched) and the extras for the record.
        """
        extra = Reduced(scalars={"diag/dist/world_size": float(self.world)})
        if not is_distributed():  # the group is gone (destroyed before close): local values only
            self._warn("gone", "trackdiag: process group destroyed before the session closed; values not reduced")
            return host, extra
        fxs = {}
        for k in host:
            i, _, key = k.partition("\t")
            fxs[k] = self.fx(probes[int(i)], key)
        keys = sorted(k for k, fx in fxs.items() if fx != "same")
        per_rank = self._gather({k: host[k] for k in keys})
        out = dict(host)
        bad_rank: dict[str, float] = {}
        for k, rows in per_rank.items():
            i, _, key = k.partition("\t")
            out[k] = self._combine(fxs.get(k, "mean"), key, rows, extra)
            first = _first_nonfinite_rank(rows)
            if first is not None:
                bad_rank[record_key(probes[int(i)], key)] = float(first)
        if bad_rank:
            extra.tables["diag/dist/nonfinite_rank"] = bad_rank
        return out, extra

    def _combine(self, fx: str, key: str, rows: list[np.ndarray], extra: Reduced) -> np.ndarray:
        if len({r.size for r in rows}) > 1:  # ragged (layouts differed): keep what every rank has
            n = min(r.size for r in rows)
            rows = [r[:n] for r in rows]
        m = np.stack(rows)
        if fx == "per_rank":
            return m.reshape(-1)
        if fx == "max_spread":
            name = key.rsplit("/", 1)[-1]
            extra.scalars[f"diag/dist/spread/{name}"] = float(np.max(m[:, 0]) - np.min(m[:, 0]))
            extra.tables[f"diag/dist/per_rank/{name}"] = {str(r): float(v) for r, v in enumerate(m[:, 0])}
            return m.max(axis=0)
        if fx == "norm":
            return np.sqrt(np.sum(m * m, axis=0))
        if fx in ("max", "min", "sum"):
            return getattr(m, fx)(axis=0)
        if fx != "mean":
            self._warn(fx, f"trackdiag: unknown dist_reduce_fx {fx!r} for {key!r}; using mean ({REDUCE_FX})")
        return m.mean(axis=0)

    def _gather(self, values: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
        """Per key, every rank's array. One flat all_gather when the layouts agree (checked first
        with a 16-byte handshake), else an object gather (warned once)."""
        dist = torch.distributed
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        layout = "\n".join(f"{k}:{v.size}" for k, v in values.items())
        digest = int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=7).digest(), "little")
        flat = np.concatenate([v.reshape(-1) for v in values.values()]) if values else np.zeros(0)
        head = torch.tensor([flat.size, digest], dtype=torch.int64, device=device)
        heads = torch.empty(2 * self.world, dtype=torch.int64, device=device)
        _all_gather(heads, head)
        if bool((heads.view(self.world, 2) == head).all()):
            if flat.size == 0:
                return {}
            mine = torch.from_numpy(flat).to(device)
            every = torch.empty(self.world * flat.size, dtype=mine.dtype, device=device)
            _all_gather(every, mine)  # the one data collective of this logging step
            table = every.view(self.world, flat.size).cpu().numpy()  # host sync
            out, pos = {}, 0
            for k, v in values.items():
                out[k] = [table[r, pos:pos + v.size] for r in range(self.world)]
                pos += v.size
            return out
        self._warn("layout", "trackdiag: ranks collected different diagnostics (a probe disabled on one rank?); "
                             "reducing the keys they share through a slower object gather")
        objs: list[Any] = [None] * self.world
        dist.all_gather_object(objs, values)
        shared = [k for k in values if all(k in o for o in objs)]
        return {k: [np.asarray(o[k]) for o in objs] for k in shared}

    def _warn(self, tag: str, msg: str) -> None:
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning(msg)


def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    dist = torch.distributed
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


def _first_nonfinite_rank(rows: list[np.ndarray]) -> int | None:
    """The rank whose array turns non-finite at the earliest index (lowest rank on a tie), or None
    when no rank's does or every rank's does at the same index (nothing singles one rank out)."""
    firsts = []
    for r in rows:
        bad = np.flatnonzero(~np.isfinite(r))
        firsts.append(int(bad[0]) if bad.size else math.inf)
    best = min(firsts)
    if best == math.inf or all(f == best for f in firsts):
        return None
    return firsts.index(best)

"""Cross-rank consistency under ``torch.distributed``: do the replicas still hold the same weights, and
do the ranks read different data?

Active only in a process group of more than one rank, for a component wrapped in
``DistributedDataParallel`` (weights and batches) or sharded with FSDP2 ``fully_shard`` (batches
only: every rank holds a different shard of each parameter, so there is nothing replicated to compare;
a shard has one owner and cannot part from a copy). Anything else (tensor or pipeline parallelism,
independent models per rank) is left alone: ranks there may legitimately hold different weights and
read the same batch. Single-process runs: nothing at all.

Emits per component (every rank publishes and judges the same record):
  ``diag/ranks/param_layers_differ``: layers whose weight fingerprints are not identical on every rank
  (0: the replicas agree within ``rtol``); ``diag/ranks/param_rel_diff``: the largest relative difference;
  tables ``diag/ranks/param_diff`` (layer -> relative difference, the first 16 differing layers in
  module order) and ``diag/ranks/param_rank_diff`` (rank -> its difference from the median of the
  ranks at the first differing layer); ``diag/ranks/same_batch``: 1 when every rank's input batch had
  the same fingerprint at this logging step, else 0 (absent when no batch was seen).
Fingerprints: per layer (its parameters as ``model.named_parameters()`` lists them, DDP's
``parameters_to_ignore`` left out) the sum and the sum of squares in float64; per batch (the first
tensor of the first training forward of the wrapped model in the step, or ``step(batch=...)``) the
element count, the sum and the sum of every other element. A layer with a non-finite fingerprint on
some rank is not compared (``nonfinite_param`` reports it).

Cost per logging step: one ``_foreach_norm`` and one sum per parameter tensor (both read every weight
once, float64 accumulation), one ``index_add_`` into ``2 x layers + 1`` numbers, two reductions of the
batch; no host sync of its own (the session's one copy), and ``world x (2 x layers + 4)`` float64
added to the session's one ``all_gather`` (:mod:`trackdiag.session.distributed`). Other steps: no
device work; one Python call (a step test) per forward of the wrapped model.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.layers import layer_of
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.ranks import is_distributed, is_sharded, world_size
from trackdiag.util.tensors import inputs_of

#: differing layers named in ``diag/ranks/param_diff`` (module order)
MAX_LAYERS = 16


def parallel_kind(comp: Component) -> str | None:
    """``"ddp"`` for a component wrapped in ``DistributedDataParallel``, ``"fsdp"`` for one sharded with
    FSDP2, None otherwise (the ranks need not be replicas). A few ``isinstance`` tests."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    outer = comp.outer if comp.outer is not None else comp.model
    for m in (outer, getattr(outer, "_orig_mod", None), comp.model):
        if isinstance(m, DDP):
            return "ddp"
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # an old torch: no FSDP2
        FSDPModule = ()  # type: ignore[assignment,misc]
    model = comp.model
    if model is not None and (isinstance(model, FSDPModule) or any(is_sharded(p) for p in model.parameters())):
        return "fsdp"
    return None


def _ddp_of(comp: Component) -> Any:
    from torch.nn.parallel import DistributedDataParallel as DDP

    outer = comp.outer
    return next((m for m in (outer, getattr(outer, "_orig_mod", None)) if isinstance(m, DDP)), None)


def batch_fingerprint(x: torch.Tensor) -> torch.Tensor:
    """``[numel, sum, sum of every other element]`` of ``x`` in float64, on its device. Two reductions,
    no batch-sized temporary (the strided view is not copied)."""
    flat = x.detach().reshape(-1)
    n = flat.new_full((1,), flat.numel(), dtype=torch.float64)
    return torch.cat([n, flat.sum(dtype=torch.float64).reshape(1), flat[1::2].sum(dtype=torch.float64).reshape(1)])


class RankSyncProbe(Probe):
    """See module docstring. Per logging step: every weight read twice, a few numbers per layer.

    Args:
        rtol: relative differences up to this count as agreement (the sum against ``sqrt(numel x sum of
            squares)``, the sum of squares against itself). DDP replicas are bit-identical on like devices;
            a tolerance only matters for ranks on different device models, whose kernels may round apart.
    """

    name = "rank_sync"
    follows_anomaly = False  # reads every weight: not on every step of an anomaly window
    dist_reduce_fx = "per_rank"  # the rule needs every rank's values, not a mean

    def __init__(self, *, enabled: bool = True, every: int | None = None, rtol: float = 1e-9) -> None:
        super().__init__(enabled=enabled, every=every)
        self.rtol = float(rtol)
        self._kinds: dict[str, str] = {}
        self._batch: dict[str, tuple[int, torch.Tensor]] = {}  # component -> (step, fingerprint)
        self._layouts: dict[str, tuple[list[str], np.ndarray]] = {}  # component -> (layers, numel per layer)
        self._stops: list[Any] = []
        self._ctx: ProbeContext | None = None

    def attach(self, ctx: ProbeContext) -> None:
        from trackdiag.capture.forward_watch import FORWARD, may_watch

        self._ctx = ctx
        if not is_distributed():
            return
        for comp in ctx.components:
            kind = parallel_kind(comp)
            if kind is None:
                continue
            self._kinds[comp.name] = kind
            root = comp.outer if comp.outer is not None else comp.model
            if root is not None and may_watch(ctx.compiled):
                self._stops.append(FORWARD.watch(root, pre=lambda m, a, c=comp.name: self._forward(c, a), root=True))

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    def _forward(self, comp: str, args: tuple[Any, ...]) -> None:
        ctx = self._ctx
        if ctx is None or not torch.is_grad_enabled() or not ctx.is_due(self.schedule):
            return
        got = self._batch.get(comp)
        if got is not None and got[0] == ctx.step:  # the step's first forward only
            return
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None:
            with torch.no_grad():
                self._batch[comp] = (ctx.step, batch_fingerprint(x))

    def quiet(self, ctx: ProbeContext) -> bool:
        return not self._kinds  # outside DDP/FSDP

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if not self._kinds or inputs.batch is None or not ctx.is_due(self.schedule):
            return
        x = inputs_of(inputs.batch)
        if isinstance(x, torch.Tensor):
            for name in self._kinds:
                got = self._batch.get(name)
                if got is None or got[0] != ctx.step:
                    with torch.no_grad():
                        self._batch[name] = (ctx.step, batch_fingerprint(x))

    @torch.no_grad()
    def _weights(self, comp: Component) -> torch.Tensor | None:
        """``[layout hash, sum_0, sumsq_0, sum_1, ...]`` in float64 on the parameters' first device."""
        ddp = _ddp_of(comp)
        ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
        named = [(n, p) for n, p in comp.model.named_parameters() if n not in ignore and not is_sharded(p)]
        if not named:
            return None
        layers = list(dict.fromkeys(layer_of(n) for n, _ in named))
        pos = {name: i for i, name in enumerate(layers)}
        numel = np.zeros(len(layers))
        for n, p in named:
            numel[pos[layer_of(n)]] += p.numel()
        self._layouts[comp.name] = (layers, numel)
        digest = hashlib.blake2b("\n".join(f"{n}:{tuple(p.shape)}" for n, p in named).encode(), digest_size=6).digest()
        device = named[0][1].device
        params = [p.detach() for _, p in named]
        sq = torch.stack([t.to(device) for t in torch._foreach_norm(params, 2, dtype=torch.float64)]) ** 2
        sums = torch.stack([p.sum(dtype=torch.float64).to(device) for p in params])
        index = torch.tensor([pos[layer_of(n)] for n, _ in named], device=device)
        per = torch.zeros(len(layers), 2, dtype=torch.float64, device=device)
        per[:, 0].index_add_(0, index, sums)
        per[:, 1].index_add_(0, index, sq)
        head = torch.tensor([float(int.from_bytes(digest, "little"))], dtype=torch.float64, device=device)
        return torch.cat([head, per.reshape(-1)])

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for comp in ctx.components:
            kind = self._kinds.get(comp.name)
            if kind is None or comp.model is None:
                continue
            if kind == "ddp":
                fp = self._weights(comp)
                if fp is not None:
                    out[f"{comp.name}|weights"] = fp
            got = self._batch.pop(comp.name, None)
            out[f"{comp.name}|batch"] = got[1] if got is not None and got[0] == ctx.step else torch.zeros(3, dtype=torch.float64)
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        world = world_size()
        for comp in ctx.components:
            b = values.get(f"{comp.name}|batch")
            if b is not None and b.size == 3 * world:
                rows = b.reshape(world, 3)
                if bool((rows[:, 0] > 0).all()):
                    record.scalars[comp.key("ranks/same_batch")] = float(bool((rows == rows[0]).all()))
            w = values.get(f"{comp.name}|weights")
            layout = self._layouts.get(comp.name)
            if w is None or layout is None or w.size != world * (1 + 2 * len(layout[0])):
                continue
            self._compare(comp, w.reshape(world, -1), layout, record)

    def _compare(self, comp: Component, rows: np.ndarray, layout: tuple[list[str], np.ndarray], record: Record) -> None:
        layers, numel = layout
        if not bool((rows[:, 0] == rows[0, 0]).all()):  # names or shapes differ between ranks
            record.scalars[comp.key("ranks/param_layers_differ")] = float(len(layers))
            record.scalars[comp.key("ranks/param_rel_diff")] = math.inf
            record.tables[comp.key("ranks/param_diff")] = {"(parameter names or shapes)": math.inf}
            return
        fp = rows[:, 1:].reshape(rows.shape[0], len(layers), 2)  # rank x layer x (sum, sumsq)
        med = np.median(fp, axis=0)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            d_sum = np.abs(fp[:, :, 0] - med[:, 0]) / (np.sqrt(numel * np.abs(med[:, 1])) + 1e-300)
            d_sq = np.abs(fp[:, :, 1] - med[:, 1]) / (np.abs(med[:, 1]) + 1e-300)
            rel = np.maximum(d_sum, d_sq)  # rank x layer
        finite = np.isfinite(fp).all(axis=(0, 2))
        differ = [i for i in range(len(layers)) if finite[i] and float(rel[:, i].max()) > self.rtol]
        record.scalars[comp.key("ranks/param_layers_differ")] = float(len(differ))
        record.scalars[comp.key("ranks/param_rel_diff")] = float(max((rel[:, i].max() for i in differ), default=0.0))
        if differ:
            record.tables[comp.key("ranks/param_diff")] = {layers[i]: float(rel[:, i].max()) for i in differ[:MAX_LAYERS]}
            record.tables[comp.key("ranks/param_rank_diff")] = {str(r): float(v) for r, v in enumerate(rel[:, differ[0]])}

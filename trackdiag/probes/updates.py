"""Update-to-weight ratio probe: how far one optimizer step moves each layer, relative to its size.

On due steps only: ``before_optimizer_step`` snapshots the parameters (one foreach copy) and their
norms; ``after_optimizer_step`` subtracts the new values in place and takes the norms of the
difference. Emits per component:

  ``diag/[<c>/]update/ratio/<layer>``: ||w_new - w_old|| / ||w_old|| of the layer's parameters
      (``nan`` for a layer whose weights are all zero); coarsened to the key budget like the
      gradient keys, the full per-layer table in ``record.tables`` when coarsened;
  ``diag/[<c>/]update/ratio_median``: the median over layers with weights (~1e-3 is the usual healthy value);
  ``diag/[<c>/]update/global_ratio``: the same ratio over all parameters at once.

Cost on a due step: a transient copy of the parameters (1x parameter memory, freed at the end of
the step), two ``_foreach_norm`` and one ``_foreach_sub_`` kernels, two ``index_add_``. Nothing on
other steps. Under ``GradScaler`` a skipped step calls neither hook, so nothing is measured.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from trackdiag.context import Component, ProbeContext
from trackdiag.probes.base import Probe, take_pending
from trackdiag.norms import tensor_norms
from trackdiag.probes.grads import publish_layers
from trackdiag.record import Record


class UpdateProbe(Probe):
    """See module docstring."""

    name = "updates"
    due_only = True  # hooks act on due steps only: the session skips them otherwise
    follows_anomaly = False  # too costly to run on every step of an anomaly window

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._snap: dict[str, tuple[Sequence[torch.Tensor], torch.Tensor]] = {}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        if not ctx.is_due(self.schedule) or not comp.index.params:
            return
        params = [p.detach() for p in comp.index.params]
        self._snap[comp.name] = (torch._foreach_mul(params, 1.0), tensor_norms(params))

    @torch.no_grad()
    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        snap = self._snap.pop(comp.name, None)
        if snap is None:
            return
        old, w_norms = snap
        torch._foreach_sub_(list(old), [p.detach() for p in comp.index.params])  # old := w_old - w_new
        d_norms = tensor_norms(list(old))
        del old
        idx = comp.index
        lw, ld = idx.per_layer_norm(w_norms), idx.per_layer_norm(d_norms)
        nan = torch.full_like(lw, math.nan)
        ratio = torch.where(lw > 0, ld / lw, nan)
        out = {"ratio": ratio,  # its median is taken on the host: CUDA's nanmedian reads its NaN count back
               "global_ratio": torch.linalg.vector_norm(d_norms) / torch.linalg.vector_norm(w_norms)}
        if idx.grouped:
            gw, gd = idx.per_group_norm(lw), idx.per_group_norm(ld)
            out["group_ratio"] = torch.where(gw > 0, gd / gw, torch.full_like(gw, math.nan))
        self._pending[comp.name] = out

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return take_pending(self._pending)

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            ratio = values.get(f"{comp.name}|ratio")
            if ratio is None:
                continue
            finite = ratio[~np.isnan(ratio)]
            record.scalars[comp.key("update/ratio_median")] = float(np.median(finite)) if finite.size else math.nan
            record.scalars[comp.key("update/global_ratio")] = float(values[f"{comp.name}|global_ratio"][0])
            publish_layers(comp.key("update/ratio"), comp, ratio, record, values.get(f"{comp.name}|group_ratio"))

    def detach(self) -> None:
        self._snap.clear()

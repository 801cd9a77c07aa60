"""Gradient-flow probe: how much gradient reaches the first layer compared with the last.

Layers are in ``LayerIndex`` order (the optimizer's parameter order, which is the forward order for
``nn.Sequential`` and for models that define their layers in the order they use them). Layers with
no gradient at all (``grad is None``: frozen, detached, unused) are skipped; they are
``stale_params``' business. A gradient that underflowed to exactly zero counts as zero.

Emits per component: ``diag/[<c>/]grad/flow_ratio`` = ||g(first layer)|| / ||g(last layer)|| (< 1:
gradients shrink on the way back to the input, > 1: they grow) and the table
``diag/[<c>/]grad/flow`` = ``{first layer: norm, last layer: norm}``.
Cost on a due step: the pre-clip gradient norms the tap took anyway, one ``index_add_`` and a host
pass over the parameters' ``grad is None``; nothing on other steps.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.grad_records import GradView
from trackdiag.capture.layers import layer_of
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe


class GradFlowProbe(Probe):
    """See module docstring."""

    name = "gradflow"
    wants_detail = True
    due_only = True  # its one step hook acts on due steps only: the session skips it otherwise

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._pending: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, list[int]] = {}  # per component: layer position of each parameter
        self._ends: dict[str, tuple[str, str]] = {}

    def on_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        idx = comp.index
        if not ctx.is_due(self.schedule) or len(idx.layers) < 2:
            return
        with torch.no_grad():
            self._measure(comp, view)

    def _measure(self, comp: Component, view: GradView) -> None:
        idx = comp.index
        pos = self._layer_of.get(comp.name)
        if pos is None:
            at = {n: i for i, n in enumerate(idx.layers)}
            pos = self._layer_of[comp.name] = [at[layer_of(n)] for n in idx.names]
        with_grad = sorted({pos[i] for i, p in enumerate(idx.params) if p.grad is not None})  # host only
        if len(with_grad) < 2:
            return
        first, last = with_grad[0], with_grad[-1]
        layer = idx.per_layer_norm(view.norms)  # pre-clip norms the tap took
        self._pending[comp.name] = torch.stack([layer[first], layer[last]])
        self._ends[comp.name] = (idx.layers[first], idx.layers[last])

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        self._layer_of.pop(comp.name, None)
        self._pending.pop(comp.name, None)

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out, self._pending = dict(self._pending), {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            v = values.get(comp.name)
            if v is None:
                continue
            first, last = self._ends[comp.name]
            record.scalars[comp.key("grad/flow_ratio")] = float(v[0] / v[1]) if v[1] > 0 else math.nan
            record.tables[comp.key("grad/flow")] = {first: float(v[0]), last: float(v[1])}

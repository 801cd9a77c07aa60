"""Gradient probe, read at the optimizer step (unscaled under AMP, after clipping).

Emits per component: ``diag/grad/global_norm`` (equal to what ``clip_grad_norm_`` returns),
``diag/grad/max_abs``, ``diag/grad/nonfinite_tensors`` (parameter tensors whose gradient holds a
NaN/Inf) and, with ``per_layer``, ``diag/grad/norm/<layer>`` (layers coarsened to the session's
``max_layer_metrics`` budget; the full per-layer table goes to ``record.tables`` when coarsened).
Cost on a logging step: one ``_foreach_norm`` kernel over the gradients (shared with the other
gradient probes of that step), one ``aminmax`` per tensor and a few reductions; nothing on other steps.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trackdiag.context import Component, ProbeContext
from trackdiag.norms import max_abs, tensor_norms  # noqa: F401  (re-exported for user probes)
from trackdiag.probes.base import Probe, take_pending
from trackdiag.record import Record


def publish_layers(prefix: str, comp: Component, per_layer: np.ndarray, record: Record, per_group: np.ndarray | None) -> None:
    """Per-layer values as metric keys ``<prefix>/<layer or group>``, plus the full table when
    the layers had to be coarsened to fit the key budget."""
    idx = comp.index
    if idx.grouped and per_group is not None:
        for g, v in zip(idx.groups, per_group.tolist()):
            record.scalars[f"{prefix}/{g}"] = v
        record.tables[prefix] = dict(zip(idx.layers, per_layer.tolist()))
    else:
        for layer, v in zip(idx.layers, per_layer.tolist()):
            record.scalars[f"{prefix}/{layer}"] = v


def first_bad_layer(comp: Component, per_layer: np.ndarray) -> str:
    """Name of the first layer (forward order) whose value is not finite, or ``""``."""
    for layer, v in zip(comp.index.layers, per_layer.tolist()):
        if not math.isfinite(v):
            return layer
    return ""


class GradProbe(Probe):
    """See module docstring. Args: ``per_layer`` also emit per-layer norms."""

    name = "grads"
    due_only = True  # hooks act on due steps only: the session skips them otherwise

    def __init__(self, *, enabled: bool = True, every: int | None = None, per_layer: bool = True) -> None:
        super().__init__(enabled=enabled, every=every)
        self.per_layer = per_layer
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        if not ctx.is_due(self.schedule) or not comp.index.params:
            return
        grads = comp.index.grads()
        norms = comp.index.grad_norms()  # shared with gradflow / nan_replay at this hook
        out = {
            "global_norm": torch.linalg.vector_norm(norms),
            "max_abs": max_abs(grads),
            "nonfinite_tensors": (~torch.isfinite(norms)).sum(),
        }
        if self.per_layer:
            layer = comp.index.per_layer_norm(norms)
            out["layer_norm"] = layer
            if comp.index.grouped:
                out["group_norm"] = comp.index.per_group_norm(layer)
        self._pending[comp.name] = out

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return take_pending(self._pending)

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            get = lambda k: values.get(f"{comp.name}|{k}")  # noqa: E731
            if get("global_norm") is None:
                continue
            for k in ("global_norm", "max_abs", "nonfinite_tensors"):
                record.scalars[comp.key(f"grad/{k}")] = float(get(k)[0])
            layer = get("layer_norm")
            if layer is not None:
                publish_layers(comp.key("grad/norm"), comp, layer, record, get("group_norm"))
                bad = first_bad_layer(comp, layer)
                if bad:
                    record.tables.setdefault(comp.key("grad/nonfinite_layers"), {})[bad] = 1.0

"""Parameter probe, read at the logging step (after every optimizer of the step ran).

Emits per component: ``diag/param/global_norm``, ``diag/param/nonfinite_tensors`` and, with
``per_layer``, ``diag/param/norm/<layer>`` (coarsened like the gradient keys).
Cost on a logging step: one ``_foreach_norm`` over the parameters; nothing on other steps.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe, take_pending
from trackdiag.probes.grads import first_bad_layer, publish_layers


class ParamProbe(Probe):
    """See module docstring. Args: ``per_layer`` also emit per-layer norms."""

    name = "params"

    def __init__(self, *, enabled: bool = True, every: int | None = None, per_layer: bool = True) -> None:
        super().__init__(enabled=enabled, every=every)
        self.per_layer = per_layer
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def _measure(self, comp: Component) -> dict[str, torch.Tensor]:
        norms = comp.index.param_norms()  # FSDP2: this rank's shard
        out = {"global_norm": torch.linalg.vector_norm(norms), "nonfinite_tensors": (~torch.isfinite(norms)).sum()}
        if self.per_layer:
            layer = comp.index.per_layer_norm(norms)
            out["layer_norm"] = layer
            if comp.index.grouped:
                out["group_norm"] = comp.index.per_group_norm(layer)
        return out

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        for comp in ctx.components:
            if comp.index.params:
                self._pending[comp.name] = self._measure(comp)
                comp.index.clear_cache()
        return take_pending(self._pending)

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            gn = values.get(f"{comp.name}|global_norm")
            if gn is None:
                continue
            record.scalars[comp.key("param/global_norm")] = float(gn[0])
            record.scalars[comp.key("param/nonfinite_tensors")] = float(values[f"{comp.name}|nonfinite_tensors"][0])
            layer = values.get(f"{comp.name}|layer_norm")
            if layer is not None:
                publish_layers(comp.key("param/norm"), comp, layer, record, values.get(f"{comp.name}|group_norm"))
                bad = first_bad_layer(comp, layer)
                if bad:
                    record.tables.setdefault(comp.key("param/nonfinite_layers"), {})[bad] = 1.0

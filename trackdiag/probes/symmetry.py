"""``symmetry``: layers whose output units are all the same unit (``symmetric_units``).

A layer initialised to one value (``nn.init.constant_``, ``zeros_``, a weight filled from one row) gives every output
unit the same weights; when the layer after it is alike, every unit gets the same gradient and they stay the same
forever: a 64-unit layer computes one feature 64 times. Nothing crashes; the model learns what one unit can.

At its due steps (the session's cadence) the probe measures, for each trained ``nn.Linear`` and ``nn.Conv*`` weight
of at least two output units, the largest spread of a weight across the units (``max over inputs of
max_u w[u, i] - min_u w[u, i]``) against the weight's largest magnitude. A layer is *symmetric* at a check when the
spread is at most ``tolerance`` (1e-6) of the magnitude and the weight was updated since the session began (its
version counter moved: a frozen averaging filter is constant by design). Emitted: ``diag/model/symmetry_checks``,
and the table ``diag/[<c>/]model/symmetric_units`` (``{layer: output units}``) for layers symmetric at two checks in
a row with an update between them (a zero-initialised layer behind another one is symmetric for its first step only).

Cost: four reductions per weight (``amax`` and ``amin`` over the units, their spread's max, an ``aminmax``; 0.1 ms for a
1024 x 1024 weight on 2 CPU threads, where ``aminmax(dim=0)`` took 1.4 ms), one host copy with the logging step's, at
the first ``checks`` (4) due steps after the weights first moved; then nothing. Sharded weights (FSDP2 DTensors) and
parametrized modules are not read.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from trackdiag.capture.context import ProbeContext
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.ranks import is_sharded

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class SymmetryProbe(Probe):
    """See module docstring. Args: ``checks`` how many due steps to measure, ``tolerance`` the spread under which a
    layer's units count as one."""

    name = "symmetry"
    follows_anomaly = False

    def __init__(self, *, enabled: bool = True, every: int | None = None, checks: int = 4,
                 tolerance: float = 1e-6) -> None:
        super().__init__(enabled=enabled, every=every)
        self.checks, self.tolerance = checks, tolerance
        self._done = 0
        self._versions: dict[int, int] = {}  # id(weight) -> its version counter when first seen
        self._last: dict[str, dict[str, tuple[int, int]]] = {}  # component -> layer -> (units, version) symmetric last check
        self._taken: list[tuple[Any, str, int, int]] = []  # (component, layer, units, version) measured this step

    def _weights(self, comp: Any) -> list[tuple[str, torch.Tensor]]:
        model = comp.model
        if model is None or self._done >= self.checks:
            return []
        out = []
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            if not isinstance(m, _LAYERS) or not isinstance(w, torch.Tensor) or not w.requires_grad \
                    or w.dim() < 2 or w.shape[0] < 2 or is_sharded(w) or hasattr(m, "parametrizations"):
                continue
            first = self._versions.setdefault(id(w), w._version)
            if w._version != first:  # trained since the session began
                out.append((name, w))
        return out

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        self._taken = []
        values = []
        for comp in ctx.components:
            for name, w in self._weights(comp):
                with torch.no_grad():  # amax and amin over the units: aminmax(dim=0) is ~10x slower on the CPU
                    flat = w.detach().reshape(w.shape[0], -1)
                    lo, hi = torch.aminmax(flat)  # the largest magnitude without an abs() copy of the weight
                    values.append(torch.stack([(flat.amax(dim=0) - flat.amin(dim=0)).amax(),
                                               torch.maximum(hi.abs(), lo.abs())]).float())
                self._taken.append((comp, name, int(w.shape[0]), w._version))
        if not values:
            return {}
        self._done += 1
        return {"spread": torch.stack([v.to(values[0].device) for v in values])}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        got = values.get("spread")
        if got is None:
            return
        record.scalars["diag/model/symmetry_checks"] = float(self._done)
        now: dict[str, dict[str, tuple[int, int]]] = {}
        for (comp, layer, units, version), (spread, scale) in zip(self._taken, got.reshape(-1, 2)):
            if spread <= self.tolerance * scale:  # all zero counts: a trained layer that stays 0
                now.setdefault(comp.name, {})[layer] = (units, version)
        for comp in ctx.components:
            before, mine = self._last.get(comp.name, {}), now.get(comp.name, {})
            both = {layer: units for layer, (units, version) in mine.items()
                    if layer in before and before[layer][1] != version}  # symmetric at both, updated in between
            if both:
                record.tables[comp.key("model/symmetric_units")] = {k: float(v) for k, v in both.items()}
        self._last = now
        self._taken = []

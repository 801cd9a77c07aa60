"""Gradient magnitude rules: ``grad_explosion`` and ``grad_vanishing`` (global and per layer)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule, latest, layer_values, points_of
from trackdiag.stats import Ema


def _qualified(comp: Component, layer: str) -> str:
    return f"{comp.name}.{layer}" if comp.name and layer else (layer or comp.name)


class GradExplosion(Rule):
    """Fires when the global gradient norm exceeds ``threshold``, a layer's norm exceeds
    ``layer_threshold``, or the global norm jumps above ``spike_factor`` x its EMA (after ``warmup``
    logging steps, and only above ``spike_min_norm``). ``where`` names the layer with the largest norm.

    Args: threshold (100, as the guides suggest), layer_threshold (100), spike_factor (10),
    spike_min_norm (1.0), ema_beta (0.9), warmup (5 logging steps).
    """

    kind = "grad_explosion"
    severity = "critical"
    hint = ("Clip gradients (torch.nn.utils.clip_grad_norm_(params, 1.0)), lower the learning rate or add "
            "warm-up, check the initialisation, add normalisation layers (BatchNorm/LayerNorm).")

    def __init__(self, *, threshold: float = 100.0, layer_threshold: float = 100.0, spike_factor: float = 10.0,
                 spike_min_norm: float = 1.0, ema_beta: float = 0.9, warmup: int = 5, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.layer_threshold = threshold, layer_threshold
        self.spike_factor, self.spike_min_norm, self.warmup = spike_factor, spike_min_norm, warmup
        self.ema_beta = ema_beta
        self._ema: dict[str, Ema] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            layers = layer_values(record, comp.key("grad/norm"))
            worst, worst_v = max(layers.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else -1.0, default=("", math.nan))
            where = _qualified(comp, worst)
            ema = self._ema.setdefault(comp.name, Ema(self.ema_beta))
            fired = False
            for step, gn in points_of(record, comp.key("grad/global_norm")):  # every step, pre-clip
                if not math.isfinite(gn):
                    continue
                if not fired and gn > self.threshold:
                    out.append(self.make(step, f"global gradient norm {gn:.3g} exceeds {self.threshold:g}; largest in {where or 'the model'} ({worst_v:.3g}).", gn, self.threshold, where))
                    fired = True
                elif not fired and ema.count >= self.warmup and gn > self.spike_min_norm and gn > self.spike_factor * ema.value:
                    limit = self.spike_factor * ema.value
                    out.append(self.make(step, f"global gradient norm {gn:.3g} jumped to {gn / ema.value:.1f}x its recent average {ema.value:.3g}; largest in {where or 'the model'}.", gn, limit, where))
                    fired = True
                ema.update(gn)
            if not fired and worst_v > self.layer_threshold:
                out.append(self.make(record.step, f"gradient norm of {where} is {worst_v:.3g} (> {self.layer_threshold:g}).", worst_v, self.layer_threshold, where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: e.state_dict() for k, e in self._ema.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.items():
            self._ema.setdefault(k, Ema(self.ema_beta)).load_state_dict(s)


class GradVanishing(Rule):
    """Fires when the global gradient norm stays below ``threshold`` (1e-7), or a layer's norm stays
    in (0, ``layer_threshold``) (1e-7), for ``patience`` consecutive logging steps (3). Layers whose
    gradient is exactly zero are left to the ``stale_params`` detector."""

    kind = "grad_vanishing"
    severity = "warning"
    hint = ("Use ReLU-family activations instead of sigmoid/tanh, Kaiming/Xavier initialisation, residual "
            "connections or normalisation layers; check for accidental detach(); consider a larger LR.")

    def __init__(self, *, threshold: float = 1e-7, layer_threshold: float = 1e-7, patience: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.layer_threshold, self.patience = threshold, layer_threshold, patience
        self._streak: dict[str, int] = {}

    def _bump(self, key: str, low: bool) -> bool:
        self._streak[key] = self._streak.get(key, 0) + 1 if low else 0
        return self._streak[key] == self.patience

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            gn = latest(record, comp.key("grad/global_norm"))
            if gn is None or not math.isfinite(gn):
                continue
            if self._bump(f"{comp.name}|", gn < self.threshold):
                out.append(self.make(record.step, f"global gradient norm {gn:.3g} below {self.threshold:g} for {self.patience} logged steps.", gn, self.threshold, comp.name))
            for layer, v in layer_values(record, comp.key("grad/norm")).items():
                if self._bump(f"{comp.name}|{layer}", 0.0 < v < self.layer_threshold):
                    where = _qualified(comp, layer)
                    out.append(self.make(record.step, f"gradient norm of {where} is {v:.3g}, below {self.layer_threshold:g} for {self.patience} logged steps.", v, self.layer_threshold, where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return dict(self._streak)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streak = dict(state)

"""Gradient magnitude rules: ``grad_explosion`` and ``grad_vanishing`` (global and per layer)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule, latest, layer_values, points_of
from trackdiag.modnames import layer_label
from trackdiag.rules._spike import SpikeDetector


def _qualified(comp: Component, layer: str) -> str:
    """``<component>.<layer>``, with the module type of a bare index (``0 (Linear)``)."""
    return layer_label(comp, layer)


class GradExplosion(Rule):
    """Fires when the pre-clip global gradient norm (every step) exceeds ``threshold`` (100, as the
    guides suggest), when it spikes (more than ``spike_z``, 6, standard deviations above the mean of
    the last ``window``, 128, norms AND more than ``spike_factor``, 10, x that mean, floored at
    ``floor_fraction``, 0.1, of the first ``warmup``, 20, norms: see
    :class:`~trackdiag.rules._spike.SpikeDetector`), or when a layer's norm exceeds
    ``layer_threshold`` (100) at a logging step. ``step`` is the exact step; ``where`` names the
    layer with the largest norm at the logging step."""

    kind = "grad_explosion"
    severity = "critical"
    hint = ("Clip gradients (torch.nn.utils.clip_grad_norm_(params, 1.0)), lower the learning rate or add "
            "warm-up, check the initialisation, add normalisation layers (BatchNorm/LayerNorm).")

    def __init__(self, *, threshold: float = 100.0, layer_threshold: float = 100.0, spike_factor: float = 10.0,
                 spike_z: float = 6.0, window: int = 128, warmup: int = 20, floor_fraction: float = 0.1,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.layer_threshold = threshold, layer_threshold
        self.spike = dict(z=spike_z, factor=spike_factor, window=window, warmup=warmup, floor_fraction=floor_fraction)
        self.spike_factor = spike_factor
        self._spikes: dict[str, SpikeDetector] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            layers = layer_values(record, comp.key("grad/norm"))
            worst, worst_v = max(layers.items(), key=lambda kv: kv[1] if math.isfinite(kv[1]) else -1.0, default=("", math.nan))
            where = _qualified(comp, worst)
            det = self._spikes.setdefault(comp.name, SpikeDetector(**self.spike))
            fired = False

            def largest(step: int) -> str:
                """Where the per-layer norms (measured on logging steps only) put the largest gradient."""
                if not worst or not math.isfinite(worst_v):
                    return ""
                return (f"; largest in {where} ({worst_v:.3g})" if step == record.step
                        else f"; at step {record.step} the largest is in {where} ({worst_v:.3g})")

            for step, gn in points_of(record, comp.key("grad/global_norm")):  # every step, pre-clip
                spike, ref = det.feed(gn)
                if fired or not math.isfinite(gn):
                    continue
                if gn > self.threshold:
                    out.append(self.make(step, f"global gradient norm {gn:.3g} exceeds {self.threshold:g}{largest(step)}.", gn, self.threshold, where))
                    fired = True
                elif spike:
                    out.append(self.make(step, f"global gradient norm {gn:.3g} jumped to {gn / ref:.1f}x its recent average {ref:.3g}{largest(step)}.", gn, self.spike_factor * ref, where))
                    fired = True
            if not fired and worst_v > self.layer_threshold:
                out.append(self.make(record.step, f"gradient norm of {where} is {worst_v:.3g} (> {self.layer_threshold:g}).", worst_v, self.layer_threshold, where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: d.state_dict() for k, d in self._spikes.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.items():
            if isinstance(s, dict) and "recent" in s:
                self._spikes.setdefault(k, SpikeDetector(**self.spike)).load_state_dict(s)


class GradVanishing(Rule):
    """Fires when the global gradient norm stays in (0, ``threshold``) (1e-7), or a layer's norm stays
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
            if self._bump(f"{comp.name}|", 0.0 < gn < self.threshold):  # exactly 0 (all frozen): stale_params
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

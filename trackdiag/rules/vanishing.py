"""``grad_vanishing``: gradients that vanish, judged against the run itself (a collapse of the
pre-clip norm that the loss does not follow; a layer far below the others)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent
from trackdiag.rules._streak import Streaks
from trackdiag.rules._weights import weights_moved
from trackdiag.rules.base import Rule, layer_values, phase_start, points_of
from trackdiag.rules.gradients import loss_points
from trackdiag.util.modnames import layer_label


class GradVanishing(Rule):
    """Gradients that vanish, judged against the run itself:

    - **collapse**: the pre-clip global norm's median over the last ``span`` (10) steps fell below
      1/``factor`` (30) of its median over the ``span`` x 4 steps before those, which were steady
      (their halves within 3x: a norm already falling fast is an optimizer converging), while the
      loss did not fall with it (its median stayed above
      ``loss_kept``, 0.8, of what it was): the model is stuck, e.g. weights grown under a learning
      rate far too high so that normalisation layers scale their gradients away. ``persistent``
      (the window's median), ``loss`` (the loss stayed); ``weights`` when an update ratio above 1
      was measured meanwhile.
    - **per layer**: a layer's norm stays below ``layer_ratio`` (1e-6) x the largest layer's norm for
      ``patience`` (3) logged steps (``persistent``): its gradient vanished on the way back.
      Layers whose gradient is exactly zero are ``stale_params``' business, and a global norm exactly 0 at every
      step of the span ``grads_missing``'s.
    ``threshold`` (default none): your own absolute floor for the global norm, ``patience`` logs.
    """

    kind = "grad_vanishing"
    hint = ("Use ReLU-family activations instead of sigmoid/tanh, Kaiming/Xavier initialisation, residual "
            "connections or normalisation layers; check for accidental detach(). A collapse right after a "
            "learning-rate change means the weights grew: lower the learning rate, add weight decay.")

    def __init__(self, *, threshold: float | None = None, layer_threshold: float | None = None, layer_ratio: float = 1e-6,
                 patience: int = 3, factor: float = 30.0, span: int = 10, loss_kept: float = 0.8, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.layer_threshold, self.layer_ratio = threshold, layer_threshold, layer_ratio
        self.patience, self.factor, self.span, self.loss_kept = patience, factor, max(3, span), loss_kept
        self._streaks = Streaks(patience)
        self._grad: dict[str, Recent] = {}
        self._loss: dict[str, Recent] = {}
        self._fired: dict[str, int] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            ps = phase_start(record)
            if ps >= 0:  # a new phase: judged against its own history only
                self._grad[comp.name], self._loss[comp.name] = Recent(), Recent()
            g = self._grad.setdefault(comp.name, Recent())
            lo = self._loss.setdefault(comp.name, Recent())
            g.extend(p for p in points_of(record, comp.key("grad/global_norm")) if p[0] >= ps)
            lo.extend(p for p in loss_points(record, comp) if p[0] >= ps)
            out += self._collapse(comp, g, lo, history, record)
            gn = points_of(record, comp.key("grad/global_norm"))
            if self.threshold is not None and gn and self._streaks.bump(f"{comp.name}|", 0.0 < gn[-1][1] < self.threshold, record.step):
                out.append(self.make(record.step, f"global gradient norm {gn[-1][1]:.3g} below your floor {self.threshold:g} for "
                                                  f"{self.patience} logged steps.", gn[-1][1], self.threshold, comp.name,
                                     ["persistent", "corroborated"]))
            out += self._layers(record, comp)
        return out

    def _collapse(self, comp: Component, g: Recent, lo: Recent, history: Sequence[Record], record: Record) -> list[Alert]:
        now = g.last_step
        if now < 0 or now - self._fired.get(comp.name, -10**9) < 4 * self.span:
            return []
        post = [v for v in g.between(now - self.span + 1, now) if math.isfinite(v)]
        pre = [v for v in g.between(now - 5 * self.span + 1, now - self.span) if math.isfinite(v)]
        if len(post) < self.span or len(pre) < 2 * self.span:
            return []
        if not any(post):  # exactly 0 at every step: no gradient reaches the weights at all (grads_missing's)
            return []
        p_now, p_before = statistics.median(post), statistics.median(pre)
        if not (p_before > 0 and p_now < p_before / self.factor):
            return []
        half = len(pre) // 2  # a norm already falling fast before (an optimizer converging, L-BFGS) is no collapse
        early, late = statistics.median(pre[:half]), statistics.median(pre[half:])
        if min(early, late) <= 0 or max(early, late) / min(early, late) > 3.0:
            return []
        l_post = [v for v in lo.between(now - self.span + 1, now) if math.isfinite(v)]
        l_pre = [v for v in lo.between(now - 5 * self.span + 1, now - self.span) if math.isfinite(v)]
        if l_post and l_pre:
            a, b = statistics.median(l_post), statistics.median(l_pre)
            if b > 0 and a < self.loss_kept * b:  # the loss fell with it: converging, not stuck
                return []
        evidence = ["persistent", "loss"] if l_post and l_pre else ["persistent"]
        start = next((s for s, v in g.points if s > now - self.span - 1 and v < p_before / self.factor), now - self.span + 1)
        if weights_moved([*history, record], comp.name, start - self.span, now):
            evidence.append("weights")
        self._fired[comp.name] = now
        msg = (f"the pre-clip global gradient norm collapsed {p_before / max(p_now, 1e-30):.0f}-fold in a few steps "
               f"(median {p_before:.3g} -> {p_now:.3g}) while the loss did not fall with it.")
        return [self.make(start, msg, p_now, p_before / self.factor, comp.name, evidence)]

    def _layers(self, record: Record, comp: Component) -> list[Alert]:
        layers = {k: v for k, v in layer_values(record, comp.key("grad/norm")).items() if math.isfinite(v)}
        top = max(layers.values(), default=0.0)
        out = []
        for layer, v in layers.items():
            low = 0.0 < v < self.layer_ratio * top or (self.layer_threshold is not None and 0.0 < v < self.layer_threshold)
            if self._streaks.bump(f"{comp.name}|{layer}", low, record.step):
                where = layer_label(comp, layer)
                out.append(self.make(self._streaks.start(f"{comp.name}|{layer}"),
                                     f"gradient norm of {where} is {v:.3g}, {v / top:.1e} of the largest layer's, for "
                                     f"{self.patience} logged steps.", v, self.layer_ratio * top, where, ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)

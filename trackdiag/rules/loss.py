"""Loss behaviour rules: ``loss_spike`` and ``loss_divergence``, judged on every step's loss."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule, loss_series, where_of
from trackdiag.stats import Ema


class LossSpike(Rule):
    """Fires at the step whose loss exceeds ``factor`` (10) x the EMA of recent losses
    (``ema_beta`` 0.9, about the last 10 steps), once ``warmup`` (20) steps are seen. To stay quiet
    when a converged loss is tiny, the reference never drops below ``floor_fraction`` (0.1) of the
    loss level at the end of warm-up."""

    kind = "loss_spike"
    severity = "warning"
    hint = ("Lower the learning rate or add warm-up, clip gradients, inspect the samples of this step's "
            "batch (outliers, bad labels), rebalance multi-task losses.")

    def __init__(self, *, factor: float = 10.0, ema_beta: float = 0.9, warmup: int = 20, floor_fraction: float = 0.1, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.ema_beta, self.warmup, self.floor_fraction = factor, ema_beta, warmup, floor_fraction
        self._ema: dict[str, Ema] = {}
        self._floor: dict[str, float] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            ema = self._ema.setdefault(key, Ema(self.ema_beta))
            fired = False
            for step, v in points:
                if not math.isfinite(v):
                    continue
                if ema.count >= self.warmup:
                    ref = max(ema.value, self._floor.get(key, 0.0))
                    if not fired and v > self.factor * ref:
                        out.append(self.make(step, f"loss {v:.4g} is {v / ref:.1f}x its recent average {ref:.4g}.", v, self.factor * ref, where_of(key)))
                        fired = True
                ema.update(v)
                if ema.count == self.warmup:
                    self._floor[key] = self.floor_fraction * abs(ema.value)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"ema": {k: e.state_dict() for k, e in self._ema.items()}, "floor": dict(self._floor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.get("ema", {}).items():
            self._ema.setdefault(k, Ema(self.ema_beta)).load_state_dict(s)
        self._floor = dict(state.get("floor", {}))


class LossDivergence(Rule):
    """Fires when the rolling median of the loss (last ``window`` steps, 20) climbs above ``factor``
    (2) x its best value AND has given back more than ``giveback`` (0.5) of the progress made since
    the first full window: the run is going backwards, not just noisy. The median makes single
    spikes (``loss_spike``'s business) invisible here."""

    kind = "loss_divergence"
    severity = "critical"
    hint = ("The learning rate is probably too high: lower it (e.g. 10x), add warm-up or LR decay, clip "
            "gradients; check that the data or loss weighting did not change mid-run.")

    def __init__(self, *, factor: float = 2.0, giveback: float = 0.5, window: int = 20, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.giveback, self.window = factor, giveback, window
        self._state: dict[str, dict[str, Any]] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            st = self._state.setdefault(key, {"recent": [], "start": math.nan, "best": math.inf})
            recent: list[float] = st["recent"]
            fired = False
            for step, v in points:
                if not math.isfinite(v):
                    continue
                recent.append(v)
                if len(recent) > self.window:
                    recent.pop(0)
                if len(recent) < self.window:
                    continue
                cur = statistics.median(recent)
                if math.isnan(st["start"]):
                    st["start"] = cur
                st["best"] = min(st["best"], cur)
                best, start = st["best"], st["start"]
                progress = max(start - best, abs(best) * 1e-3, 1e-12)
                if not fired and cur - best > (self.factor - 1.0) * abs(best) and (cur - best) > self.giveback * progress:
                    out.append(self.make(step, f"the median loss of the last {self.window} steps rose to {cur:.4g} from a best of {best:.4g}.", cur, self.factor * best, where_of(key)))
                    fired = True
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: dict(s, recent=list(s["recent"])) for k, s in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {k: dict(s, recent=list(s["recent"])) for k, s in state.items()}

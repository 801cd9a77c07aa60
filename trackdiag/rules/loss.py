"""Loss behaviour rules: ``loss_spike`` and ``loss_divergence``, judged on every step's loss."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.rules.base import Rule, loss_series, loss_where
from trackdiag.rules._spike import SpikeDetector


class LossSpike(Rule):
    """Fires at the step whose loss is a spike of the every-step loss series (see
    :class:`~trackdiag.rules._spike.SpikeDetector`): more than ``z`` (6) standard deviations above
    the mean of the last ``window`` (128) losses AND more than ``factor`` (10) x that mean (never less
    than ``floor_fraction``, 0.1, of the loss level of the first ``warmup``, 20, steps). Judged at
    every step of the series, at the logging step; one alert per window."""

    kind = "loss_spike"
    severity = "warning"
    hint = ("Lower the learning rate or add warm-up, clip gradients, inspect the samples of this step's "
            "batch (outliers, bad labels), rebalance multi-task losses.")

    def __init__(self, *, factor: float = 10.0, z: float = 6.0, window: int = 128, warmup: int = 20,
                 floor_fraction: float = 0.1, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.z, self.window, self.warmup, self.floor_fraction = factor, z, window, warmup, floor_fraction
        self._spikes: dict[str, SpikeDetector] = {}

    def _detector(self, key: str) -> SpikeDetector:
        det = self._spikes.get(key)
        if det is None:
            det = self._spikes[key] = SpikeDetector(z=self.z, factor=self.factor, window=self.window,
                                                    warmup=self.warmup, floor_fraction=self.floor_fraction)
        return det

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            det = self._detector(key)
            fired = False
            for step, v in points:
                spike, ref = det.feed(v)
                if spike and not fired:
                    out.append(self.make(step, f"loss {v:.4g} is {v / ref:.1f}x its recent average {ref:.4g} and far "
                                               f"outside its recent spread.", v, self.factor * ref, loss_where(key)))
                    fired = True
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: d.state_dict() for k, d in self._spikes.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.items():
            if isinstance(s, dict) and "recent" in s:
                self._detector(k).load_state_dict(s)


class LossDivergence(Rule):
    """Fires when the rolling median of the loss (last ``window`` steps, 20) climbs above ``factor``
    (2) x its best value AND has given back more than ``giveback`` (0.5) of the progress made since
    the first full window: the run is going backwards, not just noisy. The median makes single
    spikes (``loss_spike``'s business) invisible here. In the first ``early_steps`` (50) it also
    fires when the median of the last 5 losses exceeds ``early_factor`` (3) x the lowest of the first
    three: a loss that rises from the very start (a learning rate far too high from step 0) has no
    progress to give back."""

    kind = "loss_divergence"
    severity = "critical"
    hint = ("The learning rate is probably too high: lower it (e.g. 10x), add warm-up or LR decay, clip "
            "gradients; check that the data or loss weighting did not change mid-run.")

    def __init__(self, *, factor: float = 2.0, giveback: float = 0.5, window: int = 20, early_steps: int = 50,
                 early_factor: float = 3.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.giveback, self.window = factor, giveback, window
        self.early_steps, self.early_factor = early_steps, early_factor
        self._state: dict[str, dict[str, Any]] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            st = self._state.setdefault(key, {"recent": [], "start": math.nan, "best": math.inf, "first": []})
            recent: list[float] = st["recent"]
            fired = False
            for step, v in points:
                if not math.isfinite(v):
                    continue
                recent.append(v)
                if len(recent) > self.window:
                    recent.pop(0)
                first: list[float] = st.setdefault("first", [])
                if len(first) < 3:
                    first.append(v)
                elif not fired and step < self.early_steps and not st.get("early_fired"):
                    now = statistics.median(recent[-5:])
                    base = min(first)
                    if now > self.early_factor * abs(base) and now - base > 1e-6:
                        out.append(self.make(step, f"the loss rises from the very start: the median of the last 5 steps is "
                                                   f"{now:.4g}, {now / base:.1f}x the first losses ({base:.4g}).",
                                             now, self.early_factor * base, loss_where(key)))
                        fired = st["early_fired"] = True
                if len(recent) < self.window:
                    continue
                cur = statistics.median(recent)
                if math.isnan(st["start"]):
                    st["start"] = cur
                st["best"] = min(st["best"], cur)
                best, start = st["best"], st["start"]
                progress = max(start - best, abs(best) * 1e-3, 1e-12)
                if not fired and cur - best > (self.factor - 1.0) * abs(best) and (cur - best) > self.giveback * progress:
                    out.append(self.make(step, f"the median loss of the last {self.window} steps rose to {cur:.4g} from a best of {best:.4g}.", cur, self.factor * best, loss_where(key)))
                    fired = True
        return out

    def state_dict(self) -> dict[str, Any]:
        return {k: dict(s, recent=list(s["recent"])) for k, s in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {k: dict(s, recent=list(s["recent"])) for k, s in state.items()}


class InitialLoss(Rule):
    """Fires at the first logging step when the loss of the first steps is far above chance level:
    for classification-shaped outputs with ``C`` classes (``diag/data/num_classes``, from the output
    and the class targets), a well-initialised model starts near ln(C) (uniform predictions). The
    median of the first ``steps`` (3) losses above ``factor`` (3) x ln(C) means the logits start
    huge: weights initialised far too large (x100 init), a missing normalisation or scale, or a loss
    summed instead of averaged. ``where`` is the loss."""

    kind = "initial_loss"
    severity = "warning"
    hint = ("Check the initialisation (default PyTorch inits or std ~ 1/sqrt(fan_in); a final layer initialised "
            "near zero starts at ln(C)), input normalisation, and that the loss averages (reduction='mean').")

    def __init__(self, *, factor: float = 3.0, steps: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.steps = factor, max(1, steps)
        self._first: dict[str, list[tuple[int, float]]] = {}
        self._done: set[str] = set()

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        classes = record.scalars.get("diag/data/num_classes", -1.0)
        out: list[Alert] = []
        for key, points in loss_series(record).items():
            if key in self._done:
                continue
            first = self._first.setdefault(key, [])
            for s, v in points:
                if len(first) < self.steps and math.isfinite(v):
                    first.append((s, v))
            if len(first) < self.steps:
                continue
            self._done.add(key)
            if classes < 2:
                continue
            chance = math.log(classes)
            start = statistics.median(v for _, v in first)
            if start > self.factor * chance:
                msg = (f"the first losses (median {start:.4g}) are {start / chance:.1f}x the chance level ln({int(classes)}) "
                       f"= {chance:.3g} of a {int(classes)}-class output: the model starts far from uniform predictions.")
                out.append(self.make(first[0][0], msg, start, self.factor * chance, loss_where(key)))
        return out

"""Loss behaviour rules: ``loss_spike`` and ``loss_divergence``.

The loss going up is only half a story: a GAN generator's loss rises by design, an actor-critic's
summed loss grows as the agent gets better, a VAE's loss rises while its KL weight anneals. So a
rise is a finding; warning and critical need more (:mod:`trackdiag.core.policy`): the rise persists
and the gradients or the weights went unstable with it. Losses whose objective is not minimised
(:mod:`trackdiag.alerts.objectives`) are not judged here at all.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent
from trackdiag.rules._signed import signed_rise
from trackdiag.rules._shift import Shift, after_shift, recovered, told
from trackdiag.rules._spike import SpikeDetector
from trackdiag.rules._weights import weights_moved
from trackdiag.rules.base import Rule, loss_series, loss_where, phase_start, where_of


def grad_key(loss_key: str) -> str:
    """The gradient-norm series beside a loss series: ``diag/G/loss`` -> ``diag/G/grad/global_norm``."""
    return loss_key[: -len("loss")] + "grad/global_norm"


class _Series:
    """One loss series' recent values and those of its gradient norm."""

    def __init__(self) -> None:
        self.loss, self.grad = Recent(), Recent()


class LossSpike(Rule):
    """A step whose loss is a spike of the every-step loss series (see
    :class:`~trackdiag.rules._spike.SpikeDetector`: more than ``z``, 6, standard deviations above the
    mean of the last ``window``, 128, losses AND more than ``factor``, 10, x that mean, floored at
    ``floor_fraction``, 0.1, of the first ``warmup``, 20, losses). Judged ``settle`` (5) steps later:
    ``persistent`` when at least 3 of them stay above 3x the old level; ``corroborated`` when the
    gradient norm stays above 5x its level in at least 3 of them (at the spike step itself a high
    gradient is the same odd batch, not a second signal); over ``unambiguous`` (1000) x the level,
    ``unambiguous``. A lone spike the run shrugged off is an ``info`` finding.

    A *signed* loss (one that has been negative: a policy-gradient or actor-critic loss, whose sum over an
    episode grows as episodes lengthen, its gradient norm with it) rising that way is a change of scale, not
    instability: its ``persistent`` / ``corroborated`` evidence counts only when the weights confirm it (an
    update ratio above 1 measured from the spike to the verdict) or the loss went non-finite; otherwise it is
    an ``info`` finding. Its hint names ``objective="rl"``. Host work on the logging step only."""

    kind = "loss_spike"
    hint = ("Lower the learning rate or add warm-up, clip gradients, inspect the samples of this step's "
            "batch (outliers, bad labels), rebalance multi-task losses.")

    def __init__(self, *, factor: float = 10.0, z: float = 6.0, window: int = 128, warmup: int = 20,
                 floor_fraction: float = 0.1, settle: int = 5, unambiguous: float = 1000.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.spike = dict(z=z, factor=factor, window=window, warmup=warmup, floor_fraction=floor_fraction)
        self.factor, self.settle, self.unambiguous = factor, max(1, settle), unambiguous
        self._spikes: dict[str, SpikeDetector] = {}
        self._series: dict[str, _Series] = {}
        self._pending: dict[str, list[tuple[int, float, float]]] = {}
        self._episode: dict[str, float] = {}  # the level before the jump being followed (0: none)
        self._shifted: dict[tuple[str, int], Shift | None] = {}  # (series, pending step) -> its data-change signature
        self._negative: dict[str, int] = {}  # series -> the first step its loss was negative (a signed loss)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, history, final=False)

    def at_close(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, history, final=True)

    def _judge(self, record: Record, history: Sequence[Record], final: bool) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            if not self.minimised(where_of(key)):
                continue
            ps = phase_start(record)
            if ps >= 0:  # a new phase: its loss is judged against its own history
                self._spikes.pop(key, None), self._series.pop(key, None), self._pending.pop(key, None)
                self._episode.pop(key, None)
                self._shifted = {k: v for k, v in self._shifted.items() if k[0] != key}
                points = [p for p in points if p[0] >= ps]
            det = self._spikes.setdefault(key, SpikeDetector(**self.spike))
            ser = self._series.setdefault(key, _Series())
            ser.loss.extend(points)
            ser.grad.extend(p for p in record.series.get(grad_key(key), []) if p[0] >= ps)
            pend = self._pending.setdefault(key, [])
            for step, v in points:
                if v < 0 and key not in self._negative and math.isfinite(v):
                    self._negative[key] = step
                spike, ref = det.feed(v, level=False)
                level = self._episode.get(key, 0.0)
                if level > 0 and math.isfinite(v) and v < 3 * level:
                    self._episode[key] = level = 0.0  # back to its level: a later jump is a new incident
                if spike and level == 0.0:
                    self._episode[key] = ref
                    pend.append((step, v, ref))
            while pend and (final or self._ready(key, ser, pend[0][0], [*history, record])):
                out.append(self._verdict(key, ser, *pend.pop(0), records=[*history, record]))
        self.follow_until = max((p[0] + self.settle for k, pend in self._pending.items() for p in pend
                                 if (k, p[0]) not in self._shifted), default=-1)
        return out

    def _ready(self, key: str, ser: _Series, step: int, records: Sequence[Record]) -> bool:
        """Whether the spike at ``step`` can be judged: ``settle`` steps after it, or its data-change signature's
        horizon after that jump (:mod:`~trackdiag.rules._shift`: decided at ``settle``)."""
        last = ser.loss.last_step
        if step + self.settle > last:
            return False
        if (key, step) not in self._shifted:
            self._shifted[(key, step)] = after_shift(ser.loss, ser.grad, step, records, key[: -len("loss")] + "opt/lr")
        sh = self._shifted[(key, step)]
        return sh is None or sh.step + sh.horizon <= last

    def _verdict(self, key: str, ser: _Series, step: int, v: float, ref: float, records: Sequence[Record] = ()) -> Alert:
        neg = self._negative.get(key, -1)
        return signed_rise(self._judged(key, ser, step, v, ref, records, neg), neg)

    def _judged(self, key: str, ser: _Series, step: int, v: float, ref: float, records: Sequence[Record],
                neg: int) -> Alert:
        sh = self._shifted.pop((key, step), None)
        if sh is not None and (fell := recovered(ser.loss, ser.grad, sh.step, sh.horizon)) is not None:
            at = sh.step
            if at != step:  # the consequence of a jump the data made: the update of that batch kicked the weights
                return self.make(step, f"loss {v:.4g} is {v / ref:.1f}x its recent average {ref:.4g}, {step - at} step(s) "
                                       f"after the loss and the gradient norm jumped together at step {at}, {told(fell, sh.horizon)}",
                                 v, self.factor * ref, loss_where(key), [])
            msg = (f"loss {v:.4g} is {v / ref:.1f}x its recent average {ref:.4g}, the gradient norm jumped with it at "
                   f"the same step, {told(fell, sh.horizon)}")
            return self.make(step, msg, v, self.factor * ref, loss_where(key), [])
        after = ser.loss.between(step + 1, step + self.settle)
        evidence = []
        if after and sum(x >= 3 * ref or not math.isfinite(x) for x in after) >= min(3, len(after)):
            evidence.append("persistent")
        # the gradient norm staying high after the step (not at it: an odd batch has both at once)
        g_after, g_level = ser.grad.between(step + 1, step + self.settle), ser.grad.level(step)
        if g_after and g_level > 0 and sum(g >= 5 * g_level or not math.isfinite(g) for g in g_after) >= min(3, len(g_after)):
            evidence.append("corroborated")
        if ref > 0 and v >= self.unambiguous * ref:  # a thousandfold: no odd batch does that
            evidence.append("unambiguous")
        tail = {"persistent": "it stayed high", "corroborated": "the gradient norm stayed high after it",
                "unambiguous": f"over {self.unambiguous:g}x"}
        how = ("; " + ", ".join(tail[e] for e in evidence)) if evidence else (
            f"; the next {self.settle} steps were back to normal" if after else " at the run's last steps")
        rescaled = ""
        if neg >= 0 and evidence and "unambiguous" not in evidence and all(map(math.isfinite, after + g_after)) \
                and not weights_moved(records, where_of(key), step, step + self.settle):
            evidence = []  # a signed loss whose scale grew: a rise to record, not instability (see class docstring)
            rescaled = (f" A signed loss (negative at step {neg}), no update above the weights' size, all finite: an "
                        "RL loss summed over longer episodes? objective=\"rl\" judges it as one.")
        msg = f"loss {v:.4g} is {v / ref:.1f}x its recent average {ref:.4g}{how}.{rescaled}"
        return self.make(step, msg, v, self.factor * ref, loss_where(key), evidence)

    def incident_key(self, alert: Alert) -> str:
        return alert.where

    def state_dict(self) -> dict[str, Any]:
        return {k: d.state_dict() for k, d in self._spikes.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.items():
            if isinstance(s, dict) and "recent" in s:
                self._spikes.setdefault(k, SpikeDetector(**self.spike)).load_state_dict(s)


SPARSE = 0.25  # a loss exactly 0 on this share of its steps is levelled by means (see LossDivergence)
SPAN = 3       # ... of this many windows: a mined loss is 0 or a few hard triplets' mean, 20 of them are noise


class LossDivergence(Rule):
    """The run going backwards: the rolling median of the loss (last ``window`` steps, 20) climbs above
    ``factor`` (2) x its best value AND has given back more than ``giveback`` (0.5) of the progress
    made since the first full window; or, in the first ``early_steps`` (50), the median of the last 5 (of those after the first three)
    losses exceeds ``early_factor`` (3) x the lowest of the first three (a loss rising from the very
    start has no progress to give back). The rise alone is an ``info`` finding (curricula, annealed
    loss weights and growing episodes raise a loss too); it is ``corroborated`` when the gradient norm
    grew out of proportion with it (its median ``grad_factor``, 5, x what it was at the best loss, and
    3x more than the loss grew), ``weights`` when an update-to-weight ratio above 1 was measured, and
    then ``persistent`` when it held ``window`` more steps. A loss that is exactly 0 on a quarter of its steps or
    of a window (a margin or triplet loss on the batches where nothing is mined: a median of mostly zeros is no
    level, and anything above it "x-fold") is levelled from then on by the mean of its last ``SPAN`` (3) windows."""

    kind = "loss_divergence"
    hint = ("The learning rate is probably too high: lower it (e.g. 10x), add warm-up or LR decay, clip "
            "gradients; check that the data or loss weighting did not change mid-run.")

    def __init__(self, *, factor: float = 2.0, giveback: float = 0.5, window: int = 20, early_steps: int = 50,
                 early_factor: float = 3.0, grad_factor: float = 5.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.giveback, self.window = factor, giveback, window
        self.early_steps, self.early_factor, self.grad_factor = early_steps, early_factor, grad_factor
        self._state: dict[str, dict[str, Any]] = {}
        self._grad: dict[str, Recent] = {}
        self._loss: dict[str, Recent] = {}
        self._negative: dict[str, int] = {}  # series -> the first step its loss was negative (the hint names objective="rl")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, points in loss_series(record).items():
            comp = where_of(key)
            if not self.minimised(comp):
                continue
            ps = phase_start(record)
            if ps >= 0:  # a new phase: a new best, a new start
                self._grad.pop(key, None), self._loss.pop(key, None), self._state.pop(key, None)
                points = [p for p in points if p[0] >= ps]
            grad, loss = self._grad.setdefault(key, Recent(1024)), self._loss.setdefault(key, Recent(1024))
            grad.extend(p for p in record.series.get(grad_key(key), []) if p[0] >= ps)
            loss.extend(points)
            neg = next((p[0] for p in points if p[1] < 0), -1)
            if neg >= 0:
                self._negative.setdefault(key, neg)
            st = self._state.setdefault(key, {"recent": [], "start": math.nan, "best": math.inf, "best_step": -1,
                                              "first": [], "since": -1})
            found = self._scan(st, points)
            if found is not None:
                out.append(signed_rise(self._verdict(key, comp, st, found, grad, [*history, record]),
                                       self._negative.get(key, -1)))
        return out

    def _scan(self, st: dict[str, Any], points: list[tuple[int, float]]) -> tuple[str, int, float, float] | None:
        """Feed the new losses; the first divergence they show, as (why, step, now, base). The state is read into
        locals once and written back once (host work per value: the logging step's longest loop at ``basic``)."""
        finite = [(step, v) for step, v in points if math.isfinite(v)]
        if not finite:
            return None
        found = None
        window, span = self.window, SPAN * self.window
        recent: list[float] = st["recent"]
        longer: list[float] = st.setdefault("longer", [])  # a sparse loss's level: the mean of 3 windows
        first: list[float] = st["first"]
        seen, zeros, after = st.get("seen", 0), st.get("zeros", 0), st.get("after", 0)
        sparse, early_fired = st.get("sparse", False), st.get("early_fired", False)
        fired, has_fired = st.get("fired", False), "fired" in st
        best, best_step, start, since = st["best"], st["best_step"], st["start"], st["since"]
        early_steps, early_factor = self.early_steps, self.early_factor
        rise, giveback = self.factor - 1.0, self.giveback
        for step, v in finite:
            recent.append(v)
            if len(recent) > window:
                del recent[0]
            longer.append(v)
            if len(longer) > span:
                del longer[0]
            seen += 1
            zeros += v == 0.0
            full = len(recent) == window
            if not sparse and full and (zeros >= SPARSE * seen or recent.count(0.0) >= SPARSE * window):
                sparse, best = True, math.inf  # levels are means from here on (the start stays: progress)
            if len(first) < 3:
                first.append(v)
                after = 0
                judged = False
            else:
                after += 1  # losses since the first three (the median is of those alone:
                judged = after >= 3  # with the first ones in it, a loss falling 5.0, 0.18, 0.01 "rose")
            if judged and found is None and step < early_steps and not early_fired:
                now, base = statistics.median(recent[-min(5, after):]), min(first) or statistics.fmean(first)
                if base != 0.0 and now > early_factor * abs(base) and now - base > 1e-6:  # 0: nothing mined yet
                    found, early_fired = ("early", step, now, base), True
            if not full:
                continue
            cur = statistics.fmean(longer) if sparse else statistics.median(recent)
            if math.isnan(start):
                start = cur
            if cur < best:
                best, best_step = cur, step
            progress = max(start - best, abs(best) * 1e-3, 1e-12)
            diverged = cur - best > rise * abs(best) and (cur - best) > giveback * progress
            if not diverged:
                since = -1
                fired, has_fired = False, True
            elif since < 0:
                since = step
            if diverged and found is None and not fired:
                found, fired, has_fired = ("late", step, cur, best), True, True
        st["seen"], st["zeros"], st["after"] = seen, zeros, after
        st["best"], st["best_step"], st["start"], st["since"] = best, best_step, start, since
        if sparse:
            st["sparse"] = True
        if early_fired:
            st["early_fired"] = True
        if has_fired:
            st["fired"] = fired
        return found

    def _verdict(self, key: str, comp: str, st: dict[str, Any], found: tuple[str, int, float, float], grad: Recent,
                 records: Sequence[Record]) -> Alert:
        why, step, now, base = found
        ref_step = st["best_step"] if why == "late" and st["best_step"] >= 0 else 3
        g_then = statistics.median(grad.between(max(0, ref_step - self.window), ref_step) or [math.nan])
        g_now = statistics.median(grad.between(step - self.window + 1, step) or [math.nan])
        loss_growth = now / base if base > 0 else math.inf
        evidence = []
        if g_then > 0 and g_now >= self.grad_factor * g_then and g_now / g_then >= 3 * loss_growth:
            evidence.append("corroborated")
        if weights_moved(records, comp, ref_step, step):
            evidence.append("weights")
        if evidence and st["since"] >= 0 and step - st["since"] >= self.window:
            evidence.append("persistent")
        if why == "early":
            msg = f"the loss rises from the very start: the median of the last 5 steps is {now:.4g}, {now / base:.1f}x the first losses ({base:.4g})"
        else:
            level, span = ("mean", SPAN * self.window) if st.get("sparse") else ("median", self.window)
            msg = f"the {level} loss of the last {span} steps rose to {now:.4g} from a best of {base:.4g}"
        if "corroborated" in evidence:
            msg += f"; the gradient norm grew {g_now / g_then:.0f}x meanwhile"
        elif not evidence:
            msg += "; the gradients and the weights stayed stable (a changing objective, or a rise to watch)"
        return self.make(step, msg + ".", now, (self.early_factor if why == "early" else self.factor) * base,
                         loss_where(key), evidence)

    def state_dict(self) -> dict[str, Any]:
        return {k: dict(s, recent=list(s["recent"])) for k, s in self._state.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = {k: dict(s, recent=list(s["recent"])) for k, s in state.items()}

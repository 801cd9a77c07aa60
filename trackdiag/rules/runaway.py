"""``loss_runaway``: a minimised loss falling without bound, a loss bug said as one, at once.

A VAE whose KL term flips sign (``recon - kl``, a KL weight annealed below zero) goes from 6,550 to
-2.4e9: the loss "improves" every step, nothing spikes or diverges upwards, and the gradients only
look odd a hundred steps later. Legitimately negative losses stay silent: a normalizing flow's NLL,
an ELBO written as a negative, a log-likelihood in nats on continuous data converge; they fall by a
few times their starting size and slow down. Judged per loss series (each part of a loss the user
hands as a dict is its own series, so the part that runs away is named), objective ``minimize`` only,
on the every-step values. (A dict of parts is read as an adversarial set under ``objective: auto``: pass
``objective: minimize`` to have each part judged.)

- the **start** is the median of the first ``start_steps`` (10) finite losses of the series (of the
  phase); its **scale** is the larger of its size and the spread of those values;
- a step **runs away** when its loss is below ``-factor`` (10) x the scale for a loss that started
  positive (it went far below zero), or ``factor`` x the scale below the start for one that started
  at or below zero (orders of magnitude beyond its start), AND it is still falling without slowing: the
  median of the last ``window`` (20) steps is below that of the ``window`` before, and that fall is at
  least ``keep`` (0.9) x the fall of the ``window`` before it (a converging loss slows down; a runaway one,
  linear, quadratic or exponential, does not;
  the three windows must be there: a loss plunging in its first steps is not judged before step 60);
- the finding is at the first such step, once per series and phase: evidence ``loss`` (the loss shows
  it), and ``persistent`` when the loss kept falling without slowing over all three windows (critical); a
  loss that crossed zero both ways before (a policy-gradient loss without ``objective="rl"``) is an info
  finding whose hint names ``objective="rl"``; so is a loss that started at zero within its noise (its first
  values take both signs, or a median at or below 0 is no farther from it than their spread): it has no size of its own to be "orders of magnitude
  beyond", and a bounded loss starts there by symmetry (a negative cosine similarity, SimSiam's, starts near 0 with a
  spread of ~0.02 and falls along an S-curve to -0.7, still speeding up when it crosses any line drawn from that
  spread).

Cost: host arithmetic on the loss series the record already holds (medians of three 20-value windows at
the steps that cross the line); nothing on the device.
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
from trackdiag.rules.base import Rule, loss_series, loss_where, phase_start, where_of


class LossRunaway(Rule):
    """See module docstring."""

    kind = "loss_runaway"
    hint = ("A minimised loss falling without bound is a bug in the loss, not progress. Check each term's sign (a "
            "KL or regulariser subtracted instead of added, a KL weight annealed below zero, a log-likelihood "
            "minimised instead of its negative) and that the loss is bounded below: a term the model can grow "
            "without limit (a log-variance, a norm, an unclipped logit) runs away. Log the parts to see which.")

    def __init__(self, *, start_steps: int = 10, factor: float = 10.0, window: int = 20, keep: float = 0.9,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.start_steps, self.factor, self.window, self.keep = max(1, start_steps), factor, max(3, window), keep
        self._loss: dict[str, Recent] = {}
        self._first: dict[str, list[float]] = {}
        self._told: set[str] = set()
        self._signs: dict[str, list[int]] = {}  # series -> [last sign, sign changes]: a loss back above zero is signed
        self._lines: dict[str, tuple[float, float, float]] = {}  # series -> _line() of its full ``first``: fixed from then on

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        """At most one ``loss_runaway`` finding per loss series and phase (see module docstring)."""
        out = []
        ps = phase_start(record)
        for key, points in loss_series(record).items():
            if not self.minimised(where_of(key)):
                continue
            if ps >= 0:  # a new phase: its own start
                self._loss.pop(key, None), self._first.pop(key, None), self._told.discard(key)
                self._lines.pop(key, None)
                points = [p for p in points if p[0] >= ps]
            rec = self._loss.setdefault(key, Recent(1024))
            first = self._first.setdefault(key, [])
            signs = self._signs.setdefault(key, [0, 0])
            # the window at once when it fits: a judged step reads the points up to itself only (Recent.between), and
            # the 3 windows it reads back stay within the 1,024 kept
            bulk = len(points) + 3 * self.window <= (rec.points.maxlen or 0)
            if bulk:
                rec.extend(points)
            for s, v in points:
                if not bulk:
                    rec.extend([(s, v)])
                if not math.isfinite(v):
                    continue
                if v != 0.0 and (v > 0) != (signs[0] > 0):
                    signs[1] += signs[0] != 0  # a change of sign (the first value sets it)
                    signs[0] = 1 if v > 0 else -1
                if len(first) < self.start_steps:
                    first.append(v)
                    continue
                if key in self._told:
                    continue
                signed = signs[1] >= 2  # below zero and back: a signed loss (policy gradient), not a runaway
                found = self._judge(key, rec, first, s, v, signed)
                if found is not None:
                    self._told.add(key)
                    out.append(signed_rise(found, s if signed else -1))
        return out

    def _line(self, key: str, first: list[float]) -> tuple[float, float, float]:
        """The start, its scale and the line a runaway loss crosses (worked out once ``first`` is full: it stays so)."""
        line = self._lines.get(key)
        if line is None:
            line = self._lines[key] = self._line_of(first)
        return line

    def _line_of(self, first: list[float]) -> tuple[float, float, float]:
        start = statistics.median(first)
        scale = max(abs(start), max(first) - min(first), 1e-12)
        line = -self.factor * scale if start > 0 else start - self.factor * scale
        return start, scale, line

    def _judge(self, key: str, rec: Recent, first: list[float], step: int, value: float,
               signed: bool = False) -> Alert | None:
        start, scale, line = self._line(key, first)
        if value >= line:
            return None
        w = self.window
        meds = []
        for k in (2, 1, 0):  # the three windows ending at this step, oldest first
            vals = [v for v in rec.between(step - (k + 1) * w + 1, step - k * w) if math.isfinite(v)]
            meds.append(statistics.median(vals) if len(vals) >= max(3, w // 2) else math.nan)
        old, mid, now = meds
        if not all(math.isfinite(m) for m in meds) or not mid > now:
            return None  # too early to tell a plunge from a runaway, or no longer falling: converged there
        fall, before = mid - now, old - mid
        if fall < self.keep * before:
            return None  # slowing down: converging
        # recorded, not raised: a loss that crossed zero both ways (a policy-gradient loss: the hint names
        # objective="rl"), or one that started at zero within its noise (no size of its own to be far beyond)
        # at zero within its noise: its first values take both signs, or their spread is larger than their median's
        # distance to 0 below it (a positive start falling steeply in its first steps is no zero start)
        at_zero = min(first) <= 0.0 <= max(first) or (start <= 0 and abs(start) < scale)
        evidence = [] if signed or at_zero else ["loss"] + (["persistent"] if before > 0 else [])
        where = "below zero" if start > 0 else "beyond its start"
        msg = (f"the minimised loss {key} fell to {value:.4g} at step {step}, {where}: it started at {start:.4g} "
               f"(median of its first {len(first)} steps) and is still falling without slowing "
               f"({mid:.4g} -> {now:.4g} over the last {w} steps): a loss without a lower bound")
        if signed:
            msg += "; it has crossed zero both ways, as a policy-gradient loss does"
        elif at_zero:
            msg += (f"? It started at zero within its noise (spread {scale:.3g}), where a bounded loss such as a "
                    f"negative cosine similarity starts too: if it levels off, it had a bound")

        return self.make(step, msg + ".", value, line, loss_where(key), evidence)

    def state_dict(self) -> dict[str, Any]:
        return {"first": {k: list(v) for k, v in self._first.items()}, "told": sorted(self._told)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._first = {k: list(v) for k, v in state.get("first", {}).items()}
        self._lines = {}
        self._told = set(state.get("told", []))

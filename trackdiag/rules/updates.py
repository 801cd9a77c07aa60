"""Parameter-update rule: ``update_ratio`` (steps far from ~1e-3 of the weights). ``stale_params`` (layers
that never get a gradient or never change) is in :mod:`trackdiag.rules.stale`."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Sequence

from trackdiag.capture.components import stepped_inputs
from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent, reacted
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import Rule, layer_values, phase_start, points_of
from trackdiag.rules.gradients import loss_points
from trackdiag.util.modnames import layer_label


def qualified(comp: Component, layer: str) -> str:
    """``<component>.<layer>`` for a named component, else the layer; a bare index with its module
    type (``0 (Linear)``)."""
    return layer_label(comp, layer)


@dataclass
class _Pending:
    """A whole-model step above ``high`` waiting for what follows it."""
    step: int
    ratio: float
    where: str
    largest: float
    back: bool = False  # a later measurement was back under ``high``
    again: tuple[int, float] | None = None  # (step, ratio): still above ``high`` ``SETTLE`` or more steps later


class UpdateRatio(Rule):
    """Update-to-weight ratios ||dw||/||w|| far from the ~1e-3 of healthy training:

    - the whole model's step (``update/step_size``: the ratio over the parameters that were not all zero
      when first measured; a zero-initialised logistic regression's second step is as large as the weights
      its first step made) above ``high`` (1.0) at a measurement, raised (``unambiguous``, ``step`` = that
      measurement) once what followed confirms it: the loss or the gradient non-finite after it; in 3 of the
      ``SETTLE`` (5) steps after it the loss above ``LOSS_FACTOR`` (3) x its level before
      (:func:`~trackdiag.rules._recent.reacted`; the first 50 steps' line of ``loss_divergence``), or the gradient
      norm below 1/``GRAD_FACTOR`` (10) of its level while the loss stayed (``LOSS_KEPT``: not under 0.8x; the
      units died); or the ratio above ``high`` at every measurement up to ``SETTLE`` or more steps on. For a
      loss that is not minimised (GAN, RL) the loss's rise does not count, a gradient norm above
      ``GRAD_FACTOR`` x its level does. Dropped when none of these came and a measurement was back under
      ``high``; at the run's end, judged on what there is (fewer than 3 steps after it: dropped). The session
      logs every step while one is held (``follow_until``). The size alone does not tell: min-char-rnn's recipe
      (weights ``randn * 0.01``, Adagrad at 0.1, whose first step is lr x sign(g)) moves the weights 9.5-10x at
      step 0, then 0.98x, and learns (its RNN: the loss up to 2.6x and the gradient norm 8-50x for a few steps,
      the weights being 10x larger); online learning (batch 1, SGD at 0.5 / sqrt(t) on ``nn.Linear``'s init)
      1-3.4x at step 0 in 25 of 30 seeds, above 1 at step 1 too in 4, its per-sample loss up to 2.4x for three
      steps; a learning rate 1000x too high from step 0 (30 styles) gives 1.1-110x at its first measurement and
      mostly under 1 at its second (the weights it blew up are large), then the loss 4x to 1e8x up, non-finite,
      or the gradient dead (a policy made deterministic, ReLUs killed);
    - one layer above ``high`` for ``patience`` (3) consecutive measurements (``persistent``): a
      param group with a wrong learning rate, a weight decay that flips the weights. One
      measurement alone is not enough for a layer: parameters initialised at or near zero
      (LayerScale, zero-initialised heads, LoRA's B) grow by more than their size at first; a layer whose every
      parameter was zero when first measured (``update/born_zero``: a tied decoder's bias) is held to
      ``BORN_FACTOR`` (10) x ``high``;
    - where the optimizer steps an input, not the model (:func:`~trackdiag.capture.components.stepped_inputs`:
      style transfer's LBFGS moves the clamped image 10-100x in its first steps), a step above ``high`` is raised
      only on what followed it (the loss, a non-finite value), and layers above ``high`` are not reported;
    - a layer inside (0, ``low``) (1e-6) for ``patience`` measurements: an ``info`` finding (rarely
      touched embedding rows, an annealed schedule); a run that does not learn is ``not_learning``'s
      business. Not judged while the LR is below ``lr_fraction`` (1%) of its largest.
    Healthy runs of real scripts sit at 1e-4-0.5 (word_language_model's SGD at lr 20 with clipping at
    0.25 sits at 0.1-0.5 throughout). ``step`` is where it began; ``where`` the worst layer."""

    kind = "update_ratio"
    hint = ("A healthy update is ~1e-3 of the weights. Too large: lower the learning rate, add warm-up, clip "
            "gradients, check weight decay and the init scale. Too small: raise the learning rate (or check the "
            "schedule/param group), look for vanishing gradients or an over-large weight init.")

    #: what confirms a whole-model step above ``high`` (see above; constants, not config options)
    SETTLE, LOSS_FACTOR, GRAD_FACTOR, LOSS_KEPT = 5, 3.0, 10.0, 0.8
    #: a layer whose every parameter was zero when first measured (``update/born_zero``) is "too high" above this x
    #: ``high``: its size is what its own steps made, so under SGD at a large rate it is rewritten every step when
    #: healthy (word_language_model's recipe with tied weights: the decoder keeps only its zero-initialised bias, at
    #: lr 20 and clipping 0.25 its ratio sits at 0.5-1.9). Under SGD that ratio does not move with the rate (the steps
    #: and the size they made scale together): a rate too high on such a layer shows in the loss, not here
    BORN_FACTOR = 10.0

    def __init__(self, *, high: float = 1.0, extreme: float | None = None, low: float = 1e-6, patience: int = 3,
                 lr_fraction: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.high, self.low, self.patience, self.lr_fraction = high, low, patience, lr_fraction
        self.extreme = extreme  # accepted for older configs; the global ratio above ``high`` is judged by what follows
        self._streaks = Streaks(patience)
        self._above: set[str] = set()  # components whose global ratio is above ``high`` since a step already taken up
        self._pending: dict[str, _Pending] = {}
        self._judged: dict[str, tuple[_Pending, str]] = {}  # the last held step confirmed or cut short by the end
        self._loss: dict[str, Recent] = {}
        self._grad: dict[str, Recent] = {}
        self._max_lr: dict[str, float] = {}

    def _annealed(self, record: Record, comp: Component) -> bool:
        """True while the component's LR is far below the largest seen (a schedule's end or start)."""
        key = comp.key("opt/lr")
        lrs = [v for k, v in record.scalars.items() if (k == key or k.startswith(key + "/")) and math.isfinite(v)]
        if not lrs:
            return False
        lr = max(lrs)
        top = self._max_lr[comp.name] = max(self._max_lr.get(comp.name, 0.0), lr)
        return lr < self.lr_fraction * top

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, components, final=False)

    def at_close(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, components, final=True)

    def _judge(self, record: Record, components: Sequence[Component], final: bool) -> list[Alert]:
        out = []
        for comp in components:
            layers = {k: v for k, v in layer_values(record, comp.key("update/ratio")).items() if math.isfinite(v)}
            if not final:
                out += self._whole(record, comp, layers)
            elif (p := self._pending.get(comp.name)) is not None:
                out += self._verdict(record.step, comp, p, final=True)
            if not layers or final:
                continue
            annealed = self._annealed(record, comp)
            inputs = bool(stepped_inputs(comp))  # an image stepped and clamped: "each step rewrites it" is no fault
            born = record.tables.get(comp.key("update/born_zero")) or {}
            for direction in ("low",) if inputs else ("high", "low"):
                due = [lay for lay, v in layers.items()
                       if self._streaks.bump(f"{comp.name}|{lay}|{direction}", self._off(direction, v, annealed, lay in born),
                                             record.step)]
                if due:
                    out.append(self._layer_finding(comp, layers, due, direction))
        self.follow_until = max((p.step + self.SETTLE for p in self._pending.values()), default=-1)
        return out

    def _whole(self, record: Record, comp: Component, layers: dict[str, float]) -> list[Alert]:
        """The whole model's step: a new one above ``high`` is held, a held one judged on this record."""
        ps = phase_start(record)
        if ps >= 0:  # a new phase: its loss and gradient norm are its own
            self._loss[comp.name], self._grad[comp.name] = Recent(), Recent()
        self._loss.setdefault(comp.name, Recent()).extend(p for p in loss_points(record, comp) if p[0] >= ps)
        self._grad.setdefault(comp.name, Recent()).extend(
            p for p in points_of(record, comp.key("grad/global_norm")) if p[0] >= ps)
        # the step against the weights that were not born zero (their first steps make them)
        g = record.scalars.get(comp.key("update/step_size"), record.scalars.get(comp.key("update/global_ratio"), math.nan))
        out, p = [], self._pending.get(comp.name)
        if p is not None:
            if math.isfinite(g) and record.step > p.step:
                p.back = p.back or g <= self.high
                if not p.back and record.step >= p.step + self.SETTLE:
                    p.again = (record.step, g)
            out = self._verdict(record.step, comp, p, final=False)
        if not math.isfinite(g):
            return out
        if g <= self.high:
            self._above.discard(comp.name)
        elif comp.name not in self._above and comp.name not in self._pending and not out:
            self._above.add(comp.name)  # a new step above the weights: held for what follows
            top = max(layers, key=layers.__getitem__) if layers else ""
            self._pending[comp.name] = _Pending(record.step, g, qualified(comp, top) if top else comp.name,
                                                layers.get(top, g))
        return out

    def _verdict(self, now: int, comp: Component, p: _Pending, final: bool) -> list[Alert]:
        """Raise ``p`` when what followed confirms it, drop it when nothing did, else keep waiting."""
        loss, grad, s = self._loss.setdefault(comp.name, Recent()), self._grad.setdefault(comp.name, Recent()), p.step
        n = min(now, s + self.SETTLE) - s  # steps after it seen so far: "most of them" is 3 of ``SETTLE``
        why = ""
        inputs = bool(stepped_inputs(comp))  # an input optimised (LBFGS's first steps on an image, then clamped):
        end = min(now, s + self.SETTLE) if inputs else now  # its size is no weight scale: judged on its own steps
        if p.again and not inputs:
            why = f"it was still above {self.high:g} at every measurement up to step {p.again[0]} ({p.again[1]:.3g}x)"
        elif any(not math.isfinite(v) for v in [*loss.between(s + 1, end), *grad.between(s + 1, end)]):
            why = "the loss or the gradient went non-finite after it"
        elif n >= min(3, self.SETTLE):  # also at the end: fewer steps than that are no evidence
            if self.minimised(comp.name) and reacted(loss, s + 1, n - 1, factor=self.LOSS_FACTOR):
                why = "the loss rose after it"
            else:
                why = self._grad_left(loss, grad, s, n, self.minimised(comp.name))
        if not why and not (final or (n >= self.SETTLE and (p.back or inputs))):
            return []  # wait for the steps after it and the next measurement
        del self._pending[comp.name]
        if why or final:  # kept for the crash finding (a run that died while it was held: cut short, why "")
            self._judged[comp.name] = (p, why)
        if not why:
            return []
        what = "the optimised input" if stepped_inputs(comp) else "the weights"
        msg = (f"one optimizer step moved {what} by {p.ratio:.3g}x their own size (update-to-weight ratio of the "
               f"whole model; largest in {p.where or 'the model'}: {p.largest:.3g}); {why}.")
        return [self.make(s, msg, p.ratio, self.high, p.where, ["unambiguous"])]

    def held(self) -> list[tuple[str, int, float, str, str]]:
        """``(component, step, ratio, where, verdict)`` of the whole-model steps above ``high`` still held, or
        confirmed (``verdict``: what followed) or cut short by the run's end (``verdict`` ""): the crash finding's
        strongest evidence. A dict read, crash path only."""
        last = {k: (p, why) for k, (p, why) in self._judged.items()}
        last.update({k: (p, "") for k, p in self._pending.items()})
        return [(k, p.step, p.ratio, p.where, why) for k, (p, why) in last.items()]

    def _grad_left(self, loss: Recent, grad: Recent, s: int, n: int, minimised: bool) -> str:
        """How the gradient norm left its range in most of the ``n`` steps after ``s``: below 1/``GRAD_FACTOR`` of
        its level while the loss did not fall (the units died: the model is stuck), or, where the loss cannot tell
        (not minimised), above ``GRAD_FACTOR`` x its level; "" when it did not. (A minimised loss speaks for itself:
        min-char-rnn's gradient norm is 10-50x after its healthy first step.)"""
        level, after = grad.level(s + 1), grad.between(s + 1, s + n)
        need = min(3, len(after))
        if not after or not level > 0:
            return ""
        if not minimised and sum(v >= self.GRAD_FACTOR * level for v in after) >= need:
            return f"the gradient norm rose above {self.GRAD_FACTOR:g}x its level after it"
        lost = [v for v in loss.between(s + 1, s + n) if math.isfinite(v)]
        kept = not minimised or (bool(lost) and statistics.median(lost) >= self.LOSS_KEPT * loss.level(s + 1))
        if kept and sum(v <= level / self.GRAD_FACTOR for v in after) >= need:
            return f"the gradient norm fell below 1/{self.GRAD_FACTOR:g} of its level after it while the loss did not fall"
        return ""

    def _off(self, direction: str, v: float, annealed: bool, born_zero: bool = False) -> bool:
        """Whether ratio ``v`` is too high / too low (a ratio of exactly 0 is never "too low"); a layer born zero
        is too high above ``BORN_FACTOR`` x ``high``."""
        if direction == "high":
            return v > self.high * (self.BORN_FACTOR if born_zero else 1.0)
        return 0.0 < v < self.low and not annealed

    def _layer_finding(self, comp: Component, layers: dict[str, float], due: list[str], direction: str) -> Alert:
        worst = (max if direction == "high" else min)(due, key=lambda lay: layers[lay])
        v, where = layers[worst], qualified(comp, worst)
        start = self._streaks.start(f"{comp.name}|{worst}|{direction}")
        others = f" ({len(due)} layers in all)" if len(due) > 1 else ""
        if direction == "high":
            msg = (f"update-to-weight ratio of {where} is {v:.3g} (> {self.high:g}) for {self.patience} measurements"
                   f"{others}: each step rewrites that layer.")
            return self.make(start, msg, v, self.high, where, ["persistent"])
        msg = (f"update-to-weight ratio of {where} is {v:.3g} (< {self.low:g}) for {self.patience} measurements{others}: "
               f"the layer barely moves (rarely used rows of an embedding, or a learning rate too low for it).")
        return self.make(start, msg, v, self.low, where)

    def state_dict(self) -> dict[str, Any]:
        pending = {k: [p.step, p.ratio, p.where, p.largest, p.back, p.again] for k, p in self._pending.items()}
        recent = {k: {"loss": self._window(self._loss, k), "grad": self._window(self._grad, k)} for k in self._pending}
        return {**self._streaks.state_dict(), "max_lr": dict(self._max_lr), "above": sorted(self._above),
                "pending": pending, "recent": recent}

    def _window(self, series: dict[str, Recent], k: str) -> list[tuple[int, float]]:
        """The points a held step's verdict reads: the level before it and the steps after it."""
        s = self._pending[k].step
        return [pt for pt in series.get(k, Recent()).points if s - 32 <= pt[0] <= s + self.SETTLE]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)
        self._max_lr = dict(state.get("max_lr", {}))
        self._above = set(state.get("above", []))
        self._pending = {k: _Pending(int(v[0]), float(v[1]), str(v[2]), float(v[3]), bool(v[4]),
                                     (int(v[5][0]), float(v[5][1])) if v[5] else None)
                         for k, v in state.get("pending", {}).items()}
        for k, r in state.get("recent", {}).items():
            self._loss[k], self._grad[k] = Recent(), Recent()
            self._loss[k].extend((int(s), float(v)) for s, v in r.get("loss", []))
            self._grad[k].extend((int(s), float(v)) for s, v in r.get("grad", []))


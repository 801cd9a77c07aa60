"""``not_learning``: a run whose loss does not move below where a model that ignores its input sits.

Labels shuffled against their inputs, a learning rate far too low, a graph detached before the
model: training runs, nothing fires, and the loss sits where it started. Judged once the warm-up
is over (``warmup`` steps, 100, counted from the last step the learning rate still rose, so a
long warm-up schedule is waited for), on the medians of the first ``start_steps`` (20) and the last
``recent_steps`` (50) losses:

- **at chance** (``loss``): the task is shown (:mod:`trackdiag.alerts.task`), the recent loss is within
  ``margin`` (5%) of the chance level (or above it and flat since the start: a loss that fell far from a bad
  initialisation and is still above chance is learning, slowly) and stalled there (it fell less than ``min_fall``, 2%, over the
  last 100 steps, or the last 200 when it fell from its start first: a language model may rest at
  the entropy of its token frequencies for a hundred steps on its way down): for a classification, the entropy of the targets' class frequencies (what predicting
  the label frequencies scores; ln C for balanced classes, and when the frequencies are degenerate; for soft
  targets, mixup or label smoothing, the entropy of the mean target), for an MSE regression, the targets' variance;
  a loss that *sits* in the chance band (every 25-step median of the last 75 steps within ``margin``, or twice
  the noise of that median) and did not fall over the last 50 is judged from ``sit_after`` (60) steps after the
  learning rate last rose, not ``warmup``: the test spans 75 steps itself; before ``warmup`` a fall beyond that
  noise, however small, is a fall (a loss that starts at chance from a calibrated init and falls ~1 % in 50 steps
  on its way down is a slow start: labels at chance fall by nothing); a language model (its targets the input
  tokens shifted by one, flattened or not, or its loss shifting them) whose loss is at or below the entropy of its
  token frequencies is resting there, as language models do for a few hundred steps before they learn from the
  context, and is neither (:mod:`trackdiag.rules._lm`);
- **flat** (``persistent``, counted only with one of the others): the recent loss is less than
  ``min_drop`` (5%) below the start;
- **accuracy at chance** (``corroborated``): the last ``patience`` evaluations' accuracy
  (``log_eval(accuracy=...)``, any key with ``acc``) within 2 points (or 10%) of the majority
  class's share (1/C without it).
At chance, the message names the likely cause when one shows: no gradient at all since the start (the pre-clip
norm 0 at every step: a forward under ``no_grad`` with a loss made to require grad), a model input of one value everywhere
(``constant_inputs``), hidden units that all share one set of weights (``symmetric_units``), a weight decay that
shrinks every weight by ``DECAY_STEP`` (1 %) or more a step (lr x ``weight_decay``, ``diag/opt/weight_decay``),
weights that barely move (every layer's last update-to-weight ratio under ``STILL_UPDATES``, 1e-5, and not 0: a learning rate far too low; no update at all is other rules' to name), or a
model input under ``TINY_INPUT`` (0.01) everywhere (images scaled to [0, 1] twice).
- **exactly 0** (``loss``: a warning): every loss of the first ``start_steps`` and the last ``recent_steps`` is
  exactly 0 while the task is shown with a chance level above 0 (or the output pairs with C >= 2 classes: ln C): the loss does not measure the predictions (a loss
  weight of 0, a mask that keeps nothing; in RL, advantages all 0 before the first reward), and nothing trains.
A flat loss of a task that is not shown is an ``info`` finding (a resumed, converged run is flat
too). Held at ``patience`` (2) consecutive logging steps; ``step`` is the first of them.
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._lm import resting as lm_resting
from trackdiag.rules._recent import Recent
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import (TINY_INPUT, Rule, layer_values, loss_series, loss_where, phase_start, points_of,
                                  where_of)
from trackdiag.util.modnames import layer_label

#: lr x weight_decay from which the decay is named in the at-chance message: SGD's and AdamW's decay shrinks every weight
#: by that share a step (1 % a step: halved in 70 steps; the usual recipes: 1e-5 to 1e-4)
DECAY_STEP = 0.01
#: a largest layer update-to-weight ratio under this is named in the at-chance message (a learning rate far too low;
#: healthy training: 1e-4 to 1e-2 a step)
STILL_UPDATES = 1e-5


class NotLearning(Rule):
    """See module docstring."""

    kind = "not_learning"
    hint = ("The model is not learning from its inputs. Check that inputs and targets stay aligned (a shuffle or "
            "sort applied to one and not the other, a wrong label column), that the learning rate is not far too "
            "low (and the schedule not stuck at 0), that nothing detaches the graph (.detach(), .data, no_grad, "
            "a tensor rebuilt from .item()), and that the model gets the real inputs.")

    def __init__(self, *, warmup: int = 100, start_steps: int = 20, recent_steps: int = 50, min_drop: float = 0.05,
                 margin: float = 0.05, min_fall: float = 0.02, patience: int = 2, sit_after: int = 60,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.sit_after = sit_after
        self.min_fall = min_fall
        self.warmup, self.start_steps, self.recent_steps = warmup, start_steps, recent_steps
        self.min_drop, self.margin, self.patience = min_drop, margin, max(1, patience)
        self._loss: dict[str, Recent] = {}
        self._first: dict[str, list[float]] = {}
        self._streaks = Streaks(self.patience)
        self._task: dict[str, float] = {}
        self._lr_rose = 0  # the last step the learning rate was still rising
        self._lr_top = 0.0
        self._acc: list[tuple[int, float]] = []
        self._constant = False
        self._absmax = math.inf
        self._decay = (0.0, 0.0, 0.0)  # the largest lr x weight_decay of the optimizers, with its lr and weight_decay
        self._components: Sequence[Component] = ()
        self._moved: dict[str, float] = {}  # per component: its largest layer update-to-weight ratio, last measured
        self._moves = math.inf
        self._symmetric = ""  # a layer whose units all share one set of weights (symmetric_units), labelled
        self._grads = (False, False)  # (a pre-clip gradient norm was recorded, one of them was not 0) since the start

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        for k, v in record.scalars.items():
            if "acc" in k.rsplit("/", 1)[-1] and math.isfinite(v):
                self._acc.append((record.step, v / 100.0 if v > 1.0 else v))
                del self._acc[:-20]
                break
        return []

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        self._components = components
        self._note_context(record)
        out = []
        for key, points in loss_series(record).items():
            if not self.minimised(where_of(key)):
                continue
            ps = phase_start(record)
            if ps >= 0:  # a new phase: its own start, its own warm-up
                self._loss.pop(key, None), self._first.pop(key, None)
                self._lr_rose = max(self._lr_rose, ps)
                self._task = {k: v for k, v in self._task.items() if k == "classes"}  # the task is shown again
                self._acc.clear()
                points = [p for p in points if p[0] >= ps]
            rec = self._loss.setdefault(key, Recent(1024))
            rec.extend(points)
            first = self._first.setdefault(key, [])
            first += [v for _, v in points if math.isfinite(v)][: self.start_steps - len(first)]
            found = self._judge(key, rec, first, record.step)
            if found is not None:
                out.append(found)
        return out

    def _note_context(self, record: Record) -> None:
        self._constant = record.scalars.get("diag/data/inputs_constant_steps", 0.0) > 0  # the model input is one value
        self._absmax = record.scalars.get("diag/data/input_absmax", math.inf)  # its largest magnitude in the window
        for comp in self._components:
            ratios = [v for v in layer_values(record, comp.key("update/ratio")).values() if math.isfinite(v)]
            if ratios:  # measured at this logging step (due steps of the updates probe): the latest reading
                self._moved[comp.name] = max(ratios)
        self._moves = max(self._moved.values(), default=math.inf)
        norms = [v for comp in self._components for _, v in points_of(record, comp.key("grad/global_norm"))]
        if norms:
            self._grads = (True, self._grads[1] or any(v != 0.0 for v in norms))
        for comp in self._components:
            sym = record.tables.get(comp.key("model/symmetric_units"))
            if sym:  # found by the symmetry probe (symmetric_units): kept for the rest of the run
                self._symmetric = self._symmetric or layer_label(comp, next(iter(sym)))
        decays = [(record.scalars.get(k.replace("opt/weight_decay", "opt/lr", 1), 0.0), v)
                  for k, v in record.scalars.items() if "opt/weight_decay" in k]
        self._decay = max(((lr * wd, lr, wd) for lr, wd in decays if math.isfinite(lr * wd)), default=(0.0, 0.0, 0.0))
        for k in ("kind", "chance_loss", "marginal_entropy", "majority_share", "summed", "sequence", "shift", "next_token"):
            v = record.scalars.get(f"diag/task/{k}")
            if v is not None:
                self._task[k] = v
        if "diag/data/num_classes" in record.scalars:
            self._task["classes"] = record.scalars["diag/data/num_classes"]
        lrs = [v for k, v in record.scalars.items() if "/opt/lr" in k and math.isfinite(v)]
        if lrs:
            lr = max(lrs)
            if lr > self._lr_top * 1.01:
                self._lr_top, self._lr_rose = lr, record.step

    def _judge(self, key: str, rec: Recent, first: list[float], step: int) -> Alert | None:
        recent = [v for v in rec.between(step - self.recent_steps + 1, step) if math.isfinite(v)]
        seen = len(first) >= self.start_steps and len(recent) >= self.recent_steps // 2
        due = step - self._lr_rose >= self.warmup and seen
        # a loss that sits in the chance band is judged sooner: the test itself spans 75 steps, no fall over 50
        early = not due and seen and step - self._lr_rose >= self.sit_after
        if not due and not early:
            self._streaks.bump(key, False, step)
            return None
        start, now = statistics.median(first), statistics.median(recent)
        flat = start - now < self.min_drop * max(abs(start), 1e-12)
        chance, what = self._chance(first)
        if due and not any(first) and not any(recent):  # exactly 0 from the first step
            classes = self._task.get("classes", 0.0)
            ref, named = (chance, what) if chance > 0 else (
                (math.log(classes), f"the chance level ln C of the output's {int(classes)} classes") if classes >= 2
                else (math.nan, ""))
            if not ref > 0:  # no task shown: a loss of 0 may be what it measures
                self._streaks.bump(key, False, step)
                return None
            if not self._streaks.bump(key, True, step):
                return None
            return self.make(self._streaks.start(key), (
                f"the loss is exactly 0 at every step from the first, where {named} is {ref:.4g}: it does not measure "
                f"the predictions, so its gradient is 0 and nothing trains (a loss weight of 0, a mask or selection "
                f"that keeps nothing, the loss taken of the wrong tensors; a policy-gradient loss whose advantages are "
                f"all 0: no reward seen yet, or returns normalised over a constant; objective=\"rl\" leaves RL losses to "
                f"other rules)."), now, ref, loss_where(key),
                ["loss"])
        # at chance and stalled there: a slow learner on its way down is left alone. The loss must have fallen
        # less than ``min_fall`` over the last 100 steps, or 200 when it did fall from its start (a language
        # model learns the token frequencies first and may rest at their entropy for a hundred steps)
        span = 100 if flat else 2 * 100
        stalled = self._stalled(rec, step, span, now)
        resting = lm_resting(self._task, now, self.margin)  # a language model's first plateau (rules/_lm.py)
        # at the chance level, or stuck above it without having fallen (a loss that fell 4x from a bad init and
        # still sits above chance is a slow learner: initial_loss told of the init, the hint here would mislead)
        at_chance = (due and math.isfinite(chance) and now >= (1 - self.margin) * chance and stalled
                     and (now <= (1 + self.margin) * chance or flat) and not resting)
        if not at_chance and not resting and math.isfinite(chance) and self._sits(rec, step, chance):
            # however it got there: a miscalibrated start that fell to chance in ten steps and stayed (a label bug),
            # or a loss that jumped back to it mid-run (labels shuffled): in the band for the last 75 steps and no
            # fall over the last 50 (a loss passing through the band falls ~5% of it in 50 steps)
            # before the warm-up is over, a fall within the noise only: a loss that starts at chance (a calibrated
            # init) and falls slowly (~1 % in 50 steps) is a slow start, not labels at chance, which fall by nothing
            at_chance = self._stalled(rec, step, 50, now, least=self.min_fall if due else 0.0)
        acc = self._acc_at_chance() and (due or at_chance)
        flat = flat and (due or at_chance)  # before the warm-up is over, a flat loss alone is not judged
        evidence = (["loss"] if at_chance else []) + (["corroborated"] if acc else [])
        if evidence and flat:
            evidence.append("persistent")
        if not self._streaks.bump(key, bool(evidence) or flat, step):
            return None
        since = self._streaks.start(key)
        parts = [f"the loss went from {start:.4g} (first {self.start_steps} steps) to {now:.4g} (last {self.recent_steps})"]
        if at_chance:
            parts.append(f"which is {what} ({chance:.4g}): no better than a model that ignores its input")
        elif flat:
            parts.append(f"less than {self.min_drop:.0%} lower")
        if acc:
            parts.append(f"validation accuracy {self._acc[-1][1]:.1%} is at chance")
        if at_chance and self._grads == (True, False):
            parts.append("and no parameter has had a gradient since the start (the pre-clip gradient norm is 0 at every "
                         "step): loss.backward() is not called, the model that computes the loss is not the one "
                         "the optimizer was built over (replaced after it was built: grads_missing tells which), the "
                         "forward ran under torch.no_grad() or inference_mode (a loss given .requires_grad_(True) to "
                         "silence autograd's error trains nothing), or the loss is cut off from the model (.detach(), "
                         "a tensor rebuilt from .item())")
        elif self._constant and at_chance:
            parts.append("and it does ignore it: the input is one value everywhere (constant_inputs)")
        elif at_chance and self._symmetric:
            parts.append(f"and its layers cannot tell inputs apart: every unit of {self._symmetric} has the same weights "
                         f"(symmetric_units: a constant init)")
        elif at_chance and self._decay[0] >= DECAY_STEP:
            shrink, lr, wd = self._decay
            parts.append(f"and weight decay shrinks every weight by {shrink:.0%} a step (lr {lr:g} x weight_decay {wd:g}): "
                         f"faster than the gradients can grow them (a weight_decay meant as 1e-4 or 1e-2?)")
        elif at_chance and 0 < self._moves < STILL_UPDATES:  # exactly 0: no update lands (grads_wiped, stale_params)
            parts.append(f"and the weights barely move: the largest update-to-weight ratio of a layer is {self._moves:.2g} "
                         f"(usually 1e-4 to 1e-2: a learning rate far too low?)")
        elif at_chance and self._absmax < TINY_INPUT:
            parts.append(f"and its input is tiny: the largest value is {self._absmax:.2g} (scaled twice? "
                         f"ToTensor() already divides images by 255)")
        return self.make(since, ", ".join(parts) + ".", now, chance if at_chance else start, loss_where(key), evidence)

    def _stalled(self, rec: Recent, step: int, span: int, now: float, least: float | None = None) -> bool:
        """The loss fell less than ``least`` (default ``min_fall``) of itself or twice the noise of a 25-value median
        over the last ``span`` steps (the medians of the span's first and last 25 steps)."""
        head = [v for v in rec.between(step - span + 1, step - span + 25) if math.isfinite(v)]
        tail = [v for v in rec.between(step - 24, step) if math.isfinite(v)]
        if len(head) < 5 or len(tail) < 5:
            return False
        # a fall within twice the noise of a 25-value median is no fall (noisy losses: small batches, MSE)
        mid = statistics.median(tail)
        sigma = 1.4826 * statistics.median(abs(v - mid) for v in tail)
        noise = 2 * 1.25 * sigma / math.sqrt(len(tail))
        return statistics.median(head) - mid < max((self.min_fall if least is None else least) * abs(now), noise)

    def _sits(self, rec: Recent, step: int, chance: float) -> bool:
        """Every 25-step median of the last 75 steps within ``margin`` of ``chance`` (a loss passing through
        chance on its way down is there for one of them, not three)."""
        for lo in range(step - 74, step, 25):
            vals = [v for v in rec.between(lo, lo + 24) if math.isfinite(v)]
            if len(vals) < 5:
                return False
            mid = statistics.median(vals)
            # the band is the margin, or twice the noise of the 25-value median (a small batch's MSE scatters
            # ~25% around its mean: its medians wander more than 5% while sitting at the targets' variance)
            noise = 2 * 1.25 * 1.4826 * statistics.median(abs(v - mid) for v in vals) / math.sqrt(len(vals))
            if abs(mid - chance) > max(self.margin * abs(chance), noise):
                return False
        return True

    def _chance(self, first: Sequence[float] = ()) -> tuple[float, str]:
        kind = self._task.get("kind")
        classes = self._task.get("classes", 0.0)
        if kind is None and classes >= 2 and len(first) >= 3:
            # the task not shown (a masked loss: a graph network's training nodes, not every node the output
            # scores) but the output pairs with C classes by shape and the first losses sat near ln C: a classifier
            ln_c = math.log(classes)
            if 0.75 * ln_c <= statistics.median(first[:3]) <= 1.5 * ln_c:
                return ln_c, f"the chance level ln C of the output's {int(classes)} classes"
        if kind == 3.0 and not self._task.get("summed"):  # BCE: the label prior is what a bias alone learns
            h = self._task.get("marginal_entropy", math.nan)
            return (h, "the entropy of the label prior") if math.isfinite(h) and h > 0 else (math.nan, "")
        if kind == 1.0 and not self._task.get("summed"):
            h, ln_c = self._task.get("marginal_entropy", math.nan), self._task.get("chance_loss", math.nan)
            # the label frequencies are what a model that ignores its input can learn (a bias), unless they
            # are degenerate (InfoNCE's positives all at index 0): then uniform scores, ln C, are chance. A
            # language model (a target per position) learns the token frequencies first and may rest at their
            # entropy on its way down: there chance is ln C
            if math.isfinite(h) and h >= 0.5 * ln_c and not self._task.get("sequence"):
                return h, "the entropy of the label frequencies"
            classes = self._task.get("classes", 0.0)
            if classes >= 2 and abs(ln_c - math.log(classes)) > 0.02 * ln_c:  # soft targets (mixup, smoothing)
                return ln_c, "the entropy of the mean soft target"
            return ln_c, "the chance level ln C"
        if kind == 2.0 and not self._task.get("summed"):
            return self._task.get("chance_loss", math.nan), "the targets' variance"
        return math.nan, ""

    def _acc_at_chance(self) -> bool:
        recent = [a for s, a in self._acc if s >= self._lr_rose + self.warmup][-self.patience:]
        if len(recent) < self.patience:
            return False
        classes = self._task.get("classes", 0.0)
        base = self._task.get("majority_share", 1.0 / classes if classes >= 2 else math.nan)
        return math.isfinite(base) and max(recent) <= base + max(0.02, 0.1 * base)

    def state_dict(self) -> dict[str, Any]:
        return {"first": {k: list(v) for k, v in self._first.items()}, "task": dict(self._task),
                "lr": [self._lr_rose, self._lr_top]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._first = {k: list(v) for k, v in state.get("first", {}).items()}
        self._task = dict(state.get("task", {}))
        self._lr_rose, self._lr_top = state.get("lr", [0, 0.0])

"""What the session held or saw in the steps before a crash, strongest first, for the ``crash``
finding's lead (see :mod:`trackdiag.session.flight`):

1. an out-of-scale update: a whole-model step above the weights' size that ``update_ratio`` held for
   confirmation (or confirmed) in the last ``window`` steps;
2. a learning-rate jump: a learning rate ``LR_FACTOR`` (10) x or more above the largest logged before it,
   first seen (logged, or read from the optimizers' ``param_groups`` at the crash) in the last ``window``
   steps (a warm-up or a cosine restart never rises above its own largest value that fast); or one
   ``HELD_FACTOR`` (100) x or more above it in the last ``HELD_WINDOW`` (100) steps that every learning rate
   since has stayed at (under SGD the weights may take tens of steps at a rate x1000 to overflow);
3. a gradient-norm explosion (one of the last ``TAIL`` (3) points ``GRAD_FACTOR`` (10) x the median of the
   points before them, or +inf) or collapse (the last two under 1/``GRAD_FACTOR`` of it);
4. a loss spike: one of the last ``TAIL`` points ``LOSS_FACTOR`` (3) x that median and above every point
   before (a loss that was positive throughout).

Host work on what is already in memory, at the end of a run that died: nothing here runs per step.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

from trackdiag.capture.context import component_of
from trackdiag.core.record import Record

LR_FACTOR, GRAD_FACTOR, LOSS_FACTOR, TAIL = 10.0, 10.0, 3.0, 3
HELD_FACTOR, HELD_WINDOW = 100.0, 100
#: what each kind of evidence says about the weights (``blowup``: the hint becomes lower the LR / warm-up / clip)
UPDATE, LR, GRAD, LOSS = 0, 1, 2, 3


@dataclass(frozen=True)
class Evidence:
    """One piece of evidence: ``rank`` (``UPDATE`` strongest ... ``LOSS``), the step it names, its text."""
    rank: int
    step: int
    text: str

    @property
    def blowup(self) -> bool:
        """Whether it says the weights blew up (an update, a learning rate or a gradient out of scale)."""
        return self.rank < LOSS


def updates(held: Iterable[tuple[str, int, float, str, str]], step: int, window: int, multi: bool) -> list[Evidence]:
    """``update_ratio``'s held steps (``(component, step, ratio, where, verdict)``) within ``window`` steps."""
    out = []
    for comp, s, ratio, where, why in held:
        if not step - window <= s < step:
            continue
        who = f"{comp}'s weights" if multi and comp else "the weights"
        then = (f"update_ratio confirmed it: {why}" if why else
                "update_ratio was holding it for confirmation when the run died")
        out.append(Evidence(UPDATE, s, f"an out-of-scale update at step {s}: one optimizer step moved {who} by "
                                       f"{ratio:.3g}x their own size (largest in {where or 'the model'}); {then}"))
    return out


def lr_jumps(history: Iterable[Record], now: dict[str, float], step: int, window: int) -> list[Evidence]:
    """Learning rates (``diag/[<c>/]opt/lr[/<group>]``: the logged records, then ``now`` read at the crash)
    that rose ``LR_FACTOR`` x above the largest before them within ``window`` steps, or ``HELD_FACTOR`` x within
    ``HELD_WINDOW`` steps and stayed there (every point since at least ``HELD_FACTOR`` x that largest)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in history:
        for k, v in record.scalars.items():
            if "/opt/lr" in k and math.isfinite(v):
                series.setdefault(k, []).append((record.step, v))
    out = []
    for k, v in now.items():
        pts = sorted(dict(series.get(k, [])).items())
        if math.isfinite(v) and (not pts or pts[-1][0] < step):
            pts.append((step, v))
        jump = None
        for i in range(1, len(pts)):
            top = max(p[1] for p in pts[:i])
            held = pts[i][0] >= step - HELD_WINDOW and min(p[1] for p in pts[i:]) >= HELD_FACTOR * top
            if top > 0 and pts[i][1] >= LR_FACTOR * top and (pts[i][0] >= step - window or held):
                jump = (pts[i - 1], pts[i], pts[i][1] / top)
                break
        if jump is not None:
            (s0, v0), (s1, v1), factor = jump
            name = k[len("diag/"):].replace("opt/lr", "learning rate").replace("/", " ")
            seen = "read at the crash" if s1 == step else f"logged at step {s1}"
            out.append(Evidence(LR, s1, f"a learning-rate jump: the {name} rose {factor:.3g}x ({v0:.3g} at step {s0} "
                                        f"-> {v1:.3g} {seen})"))
    return out


def _tail(pts: list[tuple[int, float]]) -> tuple[float, list[tuple[int, float]]] | None:
    """(median of the points before the last ``TAIL``, the last ``TAIL``), or None when fewer than 3
    finite positive points come before them."""
    before, tail = [v for _, v in pts[:-TAIL]], pts[-TAIL:]
    if len(before) < 3 or not all(math.isfinite(v) and v > 0 for v in before):
        return None
    return statistics.median(before), tail


def series(points: dict[str, list[tuple[int, float]]]) -> list[Evidence]:
    """Gradient-norm explosions/collapses and loss spikes at the end of the every-step series
    (:func:`trackdiag.forensics.crash.last_points`)."""
    out = []
    for key, pts in sorted(points.items()):
        got = _tail(pts)
        if got is None:
            continue
        level, tail = got
        suffix = "grad/global_norm" if key.endswith("/grad/global_norm") else "loss"
        comp = component_of(key, suffix)
        of = f" of {comp}" if comp else ""
        span = f"steps {pts[0][0]}-{pts[-TAIL - 1][0]}"
        if suffix != "loss":
            s, v = max(tail, key=lambda p: p[1] if not math.isnan(p[1]) else -1.0)
            if v >= GRAD_FACTOR * level:
                times = f"{v / level:.3g}x " if math.isfinite(v) else ""
                out.append(Evidence(GRAD, s, f"a gradient-norm explosion at step {s}: the gradient norm{of} was {v:.3g}, "
                                             f"{times}its median of {level:.3g} over {span}"))
            elif all(math.isfinite(w) and w <= level / GRAD_FACTOR for _, w in tail[-2:]):
                s, v = tail[-2]
                out.append(Evidence(GRAD, s, f"a gradient-norm collapse from step {s}: the gradient norm{of} fell to "
                                             f"{v:.3g}, 1/{level / max(v, 1e-30):.3g} of its median of {level:.3g} over {span}"))
        else:
            top = max(v for _, v in pts[:-TAIL])
            spikes = [(s, v) for s, v in tail if math.isfinite(v) and v >= LOSS_FACTOR * level and v > top]
            if spikes:
                s, v = max(spikes, key=lambda p: p[1])
                out.append(Evidence(LOSS, s, f"a loss spike at step {s}: the loss{of} was {v:.4g}, {v / level:.3g}x its "
                                             f"median of {level:.4g} over {span}"))
    return out


def lead(evidence: list[Evidence]) -> str:
    """The finding's first sentence: every piece of evidence, strongest first."""
    ordered = sorted(evidence, key=lambda e: (e.rank, -e.step))
    first, rest = ordered[0].text, [e.text for e in ordered[1:]]
    return f"Before the crash, {first}" + (f"; also {'; '.join(rest)}" if rest else "") + "."


def hint(evidence: list[Evidence], where: str, base: str) -> str:
    """The remedies when the crash is about non-finite values: the weights blew up (lower the learning rate,
    warm-up, clip), the module named being where the values surfaced; after a loss spike alone, ``base`` after it."""
    top = min(evidence, key=lambda e: (e.rank, -e.step))
    if not top.blowup:
        return (f"The loss spiked at step {top.step} before the crash: a step too large (lower the learning rate, clip "
                f"gradients) or a bad batch at that step. " + base)
    what = {UPDATE: f"one optimizer step at step {top.step} moved the weights far beyond their size",
            LR: "the learning rate jumped" + ("" if top.text.endswith("read at the crash)") else f" at step {top.step}"),
            GRAD: f"the gradient norm left its scale at step {top.step}"}[top.rank]
    place = f"{where} is where the non-finite values surfaced, not their cause. " if where else ""
    return (f"The weights blew up before the crash ({what}): lower the learning rate (or find what raised it: a "
            f"scheduler, a param group, a resumed optimizer state), add warm-up and clip gradients "
            f"(torch.nn.utils.clip_grad_norm_). {place}").rstrip()

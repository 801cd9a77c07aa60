"""Did the data change? A jump of the loss and the gradient norm that the batches made, not the weights.

A run that moves to new data (a continual-learning task switch, a curriculum stage, another data
source, fine-tuning on a new set after pre-training in the same loop) sees the first batch of it
with a high loss and a high gradient at once, and the next ones too until the model has learned it:
the jump persists and the loss stays above its old level, which is what an explosion looks like. What
tells them apart is what came *before* the jump. An instability is made by the weights: the update
before the jump moved them too far (a learning rate raised, a gradient already out of line). New data
needs nothing before it, and the run then learns it: loss and gradient fall back together.

The *signature* (:func:`signature`, host facts of the every-step series and the logged learning rates):

- **together**: the loss of the jump step itself is up, above ``loss_factor`` (2) x its level before the
  jump and ``mads`` (6) median absolute deviations, with the gradient norm (over ``factor``, 3, x its level).
  Weights the loop re-initialised between steps (a sparse autoencoder resampling its dead latents) do the
  same: the loss 2-3x for a step or two, the norm 10-30x while the optimizer fits the new units, then both back;
- **nothing before**: the gradient norm of the step before the jump was at its level (under
  ``factor`` x), and no learning rate logged from the last logging step before the jump on is over
  ``lr_factor`` (2) x what was logged before it (an LR raised by a schedule's restart, a warm-up, a
  bug: then the weights may have made the jump, and the rules judge it as they always do). A loop
  without an optimizer (hand-written updates) logs no learning rate: an LR it raised by hand is not
  seen, so there the horizon is ``HORIZON_NO_LR`` (8): an outlier batch the run is over 8 steps later
  is let through, a raised LR is raised 8 steps after its jump instead of 5.

A jump within 2 steps after one with the signature is the same incident (:func:`after_shift`): the
hard batch's update kicked the weights and the loss of the next steps is up with it.

A jump with the signature is judged ``horizon`` (30) steps after it instead of ``settle``: when by then
both the loss and the gradient norm (medians of the last 5 steps) are under ``recover`` (0.7) x their
values at the jump (:func:`recovered`), the run is learning the new data and the finding is ``info``
saying so; otherwise it is judged on its evidence as any other jump (only later).
"""
from __future__ import annotations

import math
import statistics
from typing import NamedTuple, Sequence

from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent, above

#: steps after a jump with the data-change signature at which it is judged; without a logged learning rate (a loop
#: with no optimizer object) only a quick recovery is let through (one outlier batch, not a task switch): an LR the
#: loop raised by hand is then judged ``HORIZON_NO_LR`` steps after the jump, not ``HORIZON``
HORIZON, HORIZON_NO_LR = 30, 8


class Shift(NamedTuple):
    """A jump with the data-change signature: its step, and the steps after it at which it is judged."""

    step: int
    horizon: int


def _up(loss: Recent, step: int, factor: float, mads: float) -> bool:
    """Whether the loss at ``step`` sits above its level before it by ``factor`` x and ``mads`` MADs."""
    now = loss.between(step, step)
    level = loss.level(step)
    if not now or not math.isfinite(now[0]) or not math.isfinite(level):
        return False
    return above(now[0], level, loss.spread(step), factor, mads)


def lr_raised(records: Sequence[Record], prefix: str, step: int, factor: float = 2.0) -> bool | None:
    """Whether a learning rate under ``prefix`` (``diag/opt/lr``, ``diag/G/opt/lr``) logged from the last logging
    step before ``step`` on is over ``factor`` x its lowest value in the (up to 3) logging steps before that one
    (or that one's own, when it is the first); None when no learning rate was logged before ``step``."""
    logged = [(r.step, {k: v for k, v in r.scalars.items() if k.startswith(prefix) and isinstance(v, (int, float))})
              for r in records]
    before = [lrs for s, lrs in logged if lrs and s < step]
    if not before:
        return None
    base = dict(before[-1])
    for lrs in before[-4:-1]:
        for k, v in lrs.items():
            base[k] = min(base.get(k, v), v)
    for lrs in [before[-1], *(lrs for s, lrs in logged if lrs and s >= step)]:
        if any(v > 0 and v > factor * base.get(k, math.inf) for k, v in lrs.items()):
            return True
    return False


def signature(loss: Recent, grad: Recent, step: int, records: Sequence[Record], lr_prefix: str,
              factor: float = 3.0, mads: float = 6.0, loss_factor: float = 2.0) -> Shift | None:
    """The jump at ``step`` if it looks made by the data (see module docstring): the loss and the gradient norm up
    at the jump step itself, the gradient norm of the step before at its level, no learning rate (logged under
    ``lr_prefix``) raised; judged ``HORIZON`` steps later, ``HORIZON_NO_LR`` when no learning rate is logged."""
    if not _up(loss, step, loss_factor, mads):
        return None
    level = grad.level(step)
    before, now = grad.between(step - 1, step - 1), grad.between(step, step)
    if not before or not now or not math.isfinite(level) or not math.isfinite(before[0]) or before[0] > factor * level \
            or not now[0] > factor * level:
        return None
    raised = lr_raised(records, lr_prefix, step)
    return None if raised else Shift(step, HORIZON if raised is False else HORIZON_NO_LR)


def after_shift(loss: Recent, grad: Recent, step: int, records: Sequence[Record], lr_prefix: str, back: int = 2) -> Shift | None:
    """The data-change signature the jump at ``step`` belongs to: its own, or that of one of the ``back`` steps before
    it (the update a hard batch's gradient made kicks the weights, and the loss of the next steps is up with it: one
    outlier batch of pytorch/examples' polynomial regression made the norm 11x at one step and the loss 20x at the
    next, back 4 steps later); None without one. One incident, judged by that step's recovery."""
    return next((sh for s in range(step, step - back - 1, -1) if (sh := signature(loss, grad, s, records, lr_prefix))), None)


def recovered(loss: Recent, grad: Recent, step: int, horizon: int = HORIZON, recover: float = 0.7) -> tuple[float, float] | None:
    """``(loss, gradient norm)`` as fractions of their values at ``step`` (medians of the 5 steps up to
    ``step + horizon``) when both fell under ``recover`` x (and stayed finite), else None."""
    fracs = []
    for series in (loss, grad):
        at, late = series.between(step, step), series.between(step + horizon - 4, step + horizon)
        if not at or not late or not all(math.isfinite(v) for v in late) or not at[0] > 0:
            return None
        frac = statistics.median(late) / at[0]
        if frac >= recover:
            return None
        fracs.append(frac)
    return fracs[0], fracs[1]


def told(fell: tuple[float, float], horizon: int = HORIZON) -> str:
    """The verdict's words for a recovered jump with the signature (``fell``: :func:`recovered`'s fractions)."""
    lr = "with the learning rate unchanged" if horizon == HORIZON else "no learning rate logged"
    return (f"after a step at its usual level and {lr}: new data (a task or curriculum switch, another source, one "
            f"outlier batch) or weights the loop re-initialised (resampled dead units) rather than an instability; "
            f"{horizon} steps later the loss was at {fell[0]:.0%} and the norm at {fell[1]:.0%} of that step's.")

"""``initial_loss``: the first losses of a classification far above its chance level."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule, loss_series, loss_where, where_of

#: a model input this large in magnitude (``diag/data/input_absmax``) is named in the finding: pixels left in 0-255
LARGE_INPUT = 50.0


class InitialLoss(Rule):
    """The first losses far above chance level, once the task is shown to be a classification of
    that loss (``diag/task/kind`` = 1: the loss equals the outputs' cross-entropy against the targets,
    see :mod:`trackdiag.alerts.task`): a well-initialised classifier starts near ln(C) (``diag/task/chance_loss``,
    scaled for a summed loss). The first loss above ``unambiguous`` (10) x chance is ``unambiguous``
    (logits that large at step 0 are a broken init or a missing scale); the median of the first
    ``steps`` (3) above ``factor`` (3) x chance is a ``loss`` finding. ``where`` is the loss. A model input whose largest
    magnitude over the window (``diag/data/input_absmax``) is ``LARGE_INPUT`` (50) or more is named as the likely cause
    (data not normalised: pixels in 0-255)."""

    kind = "initial_loss"
    hint = ("Check the initialisation (default PyTorch inits or std ~ 1/sqrt(fan_in); a final layer initialised "
            "near zero starts at ln(C)), input normalisation, and that the loss averages (reduction='mean').")

    def __init__(self, *, factor: float = 3.0, unambiguous: float = 10.0, steps: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.factor, self.unambiguous, self.steps = factor, unambiguous, max(1, steps)
        self._first: dict[str, list[tuple[int, float]]] = {}
        self._done: set[str] = set()
        self._chance = math.nan

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        if record.scalars.get("diag/task/kind") == 1.0:
            self._chance = record.scalars.get("diag/task/chance_loss", math.nan)
        out: list[Alert] = []
        for key, points in loss_series(record).items():
            if key in self._done or not self.minimised(where_of(key)):
                continue
            first = self._first.setdefault(key, [])
            first += [(s, v) for s, v in points if math.isfinite(v)][: self.steps - len(first)]
            chance = self._chance
            if not first or not (chance > 0):
                if len(first) >= self.steps and record.step >= 20:
                    self._done.add(key)  # the task was never shown: nothing to compare with
                continue
            start = statistics.median(v for _, v in first)
            if first[0][1] > self.unambiguous * chance:
                evidence, start = ["unambiguous"], first[0][1]
            elif len(first) >= self.steps and start > self.factor * chance and first[0][1] > self.factor * chance:
                evidence = ["loss"]  # the first loss too: later ones alone rose after updates (the LR, not the init)
            elif len(first) >= self.steps:
                self._done.add(key)
                continue
            else:
                continue
            self._done.add(key)
            msg = (f"the first losses ({start:.4g}) are {start / chance:.1f}x the chance level {chance:.3g} of this "
                   f"classification (ln C): the model starts far from uniform predictions.")
            absmax = record.scalars.get("diag/data/input_absmax", 0.0)
            if absmax >= LARGE_INPUT:
                msg += (f" The model input reaches {absmax:.4g} in magnitude: inputs not normalised (pixels in 0-255: "
                        f"divide by 255 and standardise; raw features: standardise with the training set's mean and std) "
                        f"give first logits this large.")
            out.append(self.make(first[0][0], msg, start, self.factor * chance, loss_where(key), evidence))
        return out

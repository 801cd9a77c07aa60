"""Mode collapse: ``mode_collapse``, judged on the ``outputs`` probe's statistics."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._lm import is_language_model, resting
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import TINY_INPUT, Rule

_SUFFIX = "/out/batch_std"


#: a sample with fewer rows of the other classes than this tells nothing about predicting them (0.6 % positives:
#: ~1.5 of 256 rows; a model learns the prior first, for 100+ steps: ``not_learning`` judges one stuck there)
MIN_OTHERS = 8


def _tiny(record: Record) -> str:
    """A note on a model input too small to tell samples apart, when the data probe saw one (not_learning's line)."""
    absmax = record.scalars.get("diag/data/input_absmax", math.inf)
    return f" (its input is tiny: the largest value is {absmax:.2g}; scaled twice?)" if absmax < TINY_INPUT else ""


class ModeCollapse(Rule):
    """Fires when a model's outputs stop depending on its inputs, for ``patience`` (3) consecutive
    logged steps:

    - constant outputs: the batch std (mean over features of the std across the batch) is below
      ``std_threshold`` (1e-3, the guides' value) x the outputs' own scale (their mean absolute
      value, so outputs of any magnitude are judged alike);
    - classifiers: at least ``class_fraction`` (0.99) of a batch of at least ``min_samples`` (16)
      predicts the same class, once the task is shown to be a classification of the loss
      (``diag/task/kind``: a VAE's reconstruction beside digit labels is not a classifier), and, with the
      labels in the batch (``out/label_top_fraction``), the other classes are predicted for under half the
      rows they hold: a classifier of rare positives (0.6 % fraud) predicts the majority class for as many
      rows as there are; a sample with fewer than ``MIN_OTHERS`` (8) rows of other classes tells nothing; a
      language model whose loss sits at the entropy of its token frequencies is at its first plateau (a unigram
      model predicts its most frequent token everywhere: :mod:`trackdiag.rules._lm`).

    The streak must also span ``min_steps`` (100) optimizer steps: early in training a model often
    predicts one class, and a zero-initialised head outputs a constant, for a few dozen steps.
    ``step`` is the first logged step of the streak; ``where`` the outputs (``model outputs``, ``G outputs``). Not while
    the model input is one value everywhere (``diag/data/inputs_constant_steps``: ``constant_inputs`` names that cause);
    a model input under ``TINY_INPUT`` everywhere is named in the message.
    """

    kind = "mode_collapse"
    hint = ("Check the output head: its init, a ReLU/saturated sigmoid or a zeroed/frozen layer right before it, "
            "and the loss for a trivial minimum (class imbalance, targets not normalised). Lower the learning "
            "rate, add input noise or a diversity term to the loss; restart from an earlier checkpoint if it persists.")

    def __init__(self, *, std_threshold: float = 1e-3, class_fraction: float = 0.99, min_samples: int = 16,
                 patience: int = 3, min_steps: int = 100, **kw: Any) -> None:
        super().__init__(**kw)
        self.std_threshold, self.class_fraction, self.min_samples = std_threshold, class_fraction, min_samples
        self.patience, self.min_steps = patience, min_steps
        self._streaks = Streaks(patience)
        self._classification = False
        self._task: dict[str, float] = {}  # the task keys a language model's rest is read from (rules/_lm.py)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        self._classification = self._classification or record.scalars.get("diag/task/kind") == 1.0
        for k in ("next_token", "shift", "marginal_entropy"):
            if f"diag/task/{k}" in record.scalars:
                self._task[k] = record.scalars[f"diag/task/{k}"]
        # a model fed one value everywhere has constant outputs because of it: constant_inputs names the cause
        fed = record.scalars.get("diag/data/inputs_constant_steps", 0.0) == 0
        for key, std in record.scalars.items():
            if not key.endswith(_SUFFIX) or not math.isfinite(std):
                continue
            base = key[: -len(_SUFFIX)]  # "diag" or "diag/<component>"
            scale = record.scalars.get(f"{base}/out/scale", 1.0)
            limit = self.std_threshold * (scale if math.isfinite(scale) and scale > 0 else 1.0)
            where = base.partition("/")[2]  # the streaks' key: the component
            place = f"{where} outputs" if where else "model outputs"
            dist, top, n, ent, labels = (record.scalars.get(f"{base}/out/{s}", math.nan) for s in
                                         ("pairwise_dist", "top_class_fraction", "samples", "pred_entropy", "label_top_fraction"))
            if self._streaks.bump(f"{where}|std", fed and std < limit, record.step, self.min_steps):
                out.append(self.make(
                    self._streaks.start(f"{where}|std"),
                    f"outputs are constant across the batch: batch std {std:.3g} < {self.std_threshold:g} x their scale "
                    f"{scale:.3g} (mean pairwise distance {dist:.3g}) since step {self._streaks.start(where + '|std')}.",
                    std, limit, place, ["persistent"]))
            single = self._classification and math.isfinite(top) and n >= self.min_samples and top >= self.class_fraction
            if single and is_language_model(self._task):  # its most frequent token everywhere, at its frequencies' loss
                losses = [v for _, v in record.series.get(f"{base}/loss", ()) if math.isfinite(v)]
                single = not (losses and resting(self._task, statistics.median(losses)))
            if single and math.isfinite(labels):  # the labels themselves: as concentrated (rare positives) is no collapse
                if (1.0 - labels) * n < MIN_OTHERS:
                    continue  # (almost) one class in the sample: it tells nothing either way
                single = 1.0 - top < 0.5 * (1.0 - labels)  # the other classes predicted for under half the rows they hold
            if self._streaks.bump(f"{where}|class", fed and single, record.step, self.min_steps):
                out.append(self.make(
                    self._streaks.start(f"{where}|class"),
                    f"{top:.0%} of the batch predicts a single class (prediction entropy {ent:.3g} nats) "
                    f"since step {self._streaks.start(where + '|class')}{_tiny(record)}.",
                    top, self.class_fraction, place, ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)

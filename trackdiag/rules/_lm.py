"""A language model at rest on the entropy of its token frequencies: the usual first plateau of a language model.

A language model learns the token frequencies first (the output bias alone gets there) and may rest at their entropy
for a few hundred steps before it learns from the context: a 2-layer LSTM of pytorch/examples' word_language_model
does (~200 steps on a corpus of near-uniform token frequencies, where that entropy is within a few percent of ln C).
There it predicts the most frequent token everywhere and its loss is that of a model that ignores its input, both
what a broken run shows too (``not_learning``, ``mode_collapse``): for a language model neither is said while the loss
sits at or below that entropy. Known from the task the loss showed (:mod:`trackdiag.alerts.task`): the targets are the
input tokens shifted by one (``diag/task/next_token``) or the loss shifts them (``diag/task/shift``).
"""
from __future__ import annotations

import math
from typing import Mapping

#: a loss up to this share above the token frequencies' entropy is at rest on it
MARGIN = 0.05


def is_language_model(task: Mapping[str, float]) -> bool:
    """Whether the task keys (``diag/task/<key>`` values by key) show a language model."""
    return bool(task.get("next_token") or task.get("shift"))


def resting(task: Mapping[str, float], loss: float, margin: float = MARGIN) -> bool:
    """A language model whose ``loss`` is at or below ``(1 + margin)`` x the entropy of its token frequencies
    (``marginal_entropy``): it learned them and may rest there (see the module docstring)."""
    h = task.get("marginal_entropy", math.nan)
    return is_language_model(task) and math.isfinite(h) and h > 0 and math.isfinite(loss) and loss <= (1 + margin) * h

"""The targets' class frequencies over the first steps: what a model that ignores its input can reach.

:class:`Marginal` accumulates them on the device (one scatter of the step's targets a step, for 20 steps, then
nothing); :func:`entropy` turns them into the chance level ``not_learning`` judges against (the Miller-Madow entropy)
and the majority share. Read by the ``loss`` probe with its logging step's one host copy.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from trackdiag.alerts.task import _float_target
from trackdiag.util.tensors import class_dim, logits_of, targets_of


class Marginal:
    """The class frequencies of the targets over the first ``steps`` (20) steps, accumulated on the
    device (one ``bincount`` of the step's targets per step, then nothing): a model that ignores
    its input reaches the entropy of these frequencies, not ln C, when classes are imbalanced. For 0/1
    targets of the output's size (a BCE), each label's counts of 0s and 1s."""

    def __init__(self, steps: int = 20) -> None:
        self.steps, self.seen = steps, 0
        self.tries = 0  # steps looked at: a loop whose batch holds no targets stops being looked at after 2 x steps
        self.counts: torch.Tensor | None = None
        self.done = False
        self.binary = False  # the counts are (labels, 2): each label's 0s and 1s
        self.soft: torch.Tensor | None = None  # (B, C) float targets: each class's summed mass (soft targets)

    @property
    def wants(self) -> bool:
        """Whether :meth:`add` still looks at steps (checked by the caller: after the first steps, a step pays
        no call and no ``no_grad`` context for it)."""
        return not self.done and self.seen < self.steps and self.tries < 2 * self.steps

    @torch.no_grad()
    def add(self, outputs: Any, batch: Any) -> None:
        if not self.wants:
            return
        self.tries += 1
        logits, t = logits_of(outputs), targets_of(batch)
        dim = class_dim(logits, t) if logits is not None and t is not None else None
        if logits is not None and (dim is None or logits.shape[dim] == 1):
            y = _float_target(batch, logits) if t is None else None
            if y is not None and y.is_floating_point() and y.shape == logits.shape and y.dim() == 2 and y.shape[1] > 1:
                self._add_soft(y)  # soft targets or multi-hot ones: the task tells which (``take``)
            self._add_binary(logits, t, batch)
            return
        if dim is None or t is None or logits is None:
            return
        c = int(logits.shape[dim])
        flat = t.reshape(-1)
        valid = ((flat >= 0) & (flat < c)).float()
        # a scatter into C counts: torch.bincount reads its largest index back (a sync on CUDA)
        counts = torch.zeros(c, dtype=torch.float32, device=flat.device).scatter_add_(0, flat.clamp(0, c - 1), valid)
        if self.counts is None or self.counts.numel() != c:
            self.counts = counts
        else:
            self.counts = self.counts + counts
        self.seen += 1

    def _add_soft(self, y: torch.Tensor) -> None:
        """Soft targets ``(B, C)`` (mixup, label smoothing): each class's summed probability mass, as counts."""
        counts = y.detach().float().clamp_min(0.0).sum(0)
        self.soft = counts if self.soft is None or self.soft.shape != counts.shape else self.soft + counts

    def _add_binary(self, logits: torch.Tensor, t: torch.Tensor | None, batch: Any) -> None:
        """0/1 targets of the output's size (a BCE): per label, the counts of 0s and 1s, ``(labels, 2)``."""
        y = t if t is not None and t.numel() == logits.numel() else _float_target(batch, logits)
        if y is None or y.numel() < 2:
            return
        yf = y.detach().float()
        cols = yf.reshape(yf.shape[0] if yf.dim() >= 1 and yf.shape[0] > 1 else yf.numel(), -1)
        ok = ((cols == 0) | (cols == 1)).float()  # anything else (soft labels) is left out
        ones = (cols * ok).sum(0)
        counts = torch.stack([ok.sum(0) - ones, ones], dim=1)
        self.binary = True
        if self.counts is None or self.counts.shape != counts.shape:
            self.counts = counts
        else:
            self.counts = self.counts + counts
        self.seen += 1

    def take(self, soft: bool = False) -> torch.Tensor | None:
        """The counts once ``steps`` steps were seen (once), else None; ``soft`` (the task showed a soft-target
        cross-entropy): each class's summed target mass instead."""
        if self.done or self.seen < self.steps or self.counts is None:
            return None
        self.done = True
        if soft and self.soft is not None:
            self.binary = False
            return self.soft
        return self.counts


def entropy(counts: Any) -> tuple[float, float]:
    """The Miller-Madow entropy (nats) of class ``counts`` and the largest class's share; for ``(labels, 2)``
    counts (a binary or multi-label task), the means over the labels of both."""
    import numpy as np

    if np.ndim(counts) == 2:
        got = [entropy(row) for row in np.asarray(counts)]
        got = [g for g in got if math.isfinite(g[0])]
        if not got:
            return math.nan, math.nan
        return float(np.mean([g[0] for g in got])), float(np.mean([g[1] for g in got]))
    n = float(np.sum(counts))
    if n <= 0:
        return math.nan, math.nan
    p = np.asarray(counts, dtype=np.float64) / n
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() + (len(nz) - 1) / (2 * n)), float(p.max())

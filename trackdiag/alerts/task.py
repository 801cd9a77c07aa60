"""Which task the loss measures, shown rather than guessed from the batch's shapes.

A batch ``(x, y)`` with integer ``y`` and an output whose shape pairs with it looks like a
classification, but a VAE's 784-wide reconstruction next to unused digit labels looks the same, and
a language model shifts its labels inside ``forward``. So task-specific rules (chance level,
single-class collapse, label leak, pre-flight fitting) run only once the task is *shown*: at one of
the first steps, the loss the user passed equals the cross-entropy of the outputs against the
targets (mean or summed over the targets, padding ignored; the targets shifted by one position as
a language model does, or not), or the mean squared error against float targets of the output's
shape (a regression, whose chance level is the targets' variance) and not, closer, their binary
cross-entropy (per-pixel BCE on 0/1 targets: left unknown).

Cost: on the first ``STEPS`` steps only, one cross-entropy (or MSE and BCE) of the step's outputs, on the
device, kept by reference and read with the logging step's one host copy; nothing afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trackdiag.util.tensors import TARGET_KEYS, class_dim, logits_of, pick, targets_of

STEPS = 3  # the first steps whose loss is compared with the outputs' cross-entropy / MSE
TOL = 0.02  # relative: an autocast loss and our fp32 recomputation agree to ~1e-3
TOL_ACCUM = 0.35  # several backward passes in the step: the loss is over micro-batches, the outputs the last one's


@dataclass
class Task:
    """``kind``: ``classification`` | ``regression`` | ``unknown``; ``chance``: the loss a model
    that ignores its input gets (ln C for C classes, the targets' variance for MSE; times the number
    of targets for a summed loss); ``classes``; ``reduction`` (``mean`` | ``sum``); ``shift``: the
    loss compares position t with target t+1 (a causal language model shifting its labels)."""

    kind: str = "unknown"
    chance: float = math.nan
    classes: int = -1
    reduction: str = "mean"
    shift: bool = False
    sequence: bool = False  # one target per position (a language model), not per sample


def masked_ce(scores: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of ``scores`` (``(..., C)``) against class targets ``t`` (``(...)``) over the
    targets inside ``[0, C)`` (padding values such as -100 or -1 are left out, as ``ignore_index``
    does), and their count. No host read and no out-of-range index (a device assert on CUDA)."""
    c = scores.shape[-1]
    valid = (t >= 0) & (t < c)
    lse = torch.logsumexp(scores, dim=-1)
    picked = scores.gather(-1, t.clamp(0, c - 1).unsqueeze(-1)).squeeze(-1)
    n = valid.sum()
    return torch.where(valid, lse - picked, 0.0).sum() / n.clamp_min(1), n.float()


@torch.no_grad()
def terms(outputs: Any, batch: Any) -> dict[str, torch.Tensor] | None:
    """Device scalars that tell the task of one step: ``ce`` / ``ce_shift`` (class targets, mean over
    the non-padding targets) with ``n`` (their count); or ``mse``, ``var`` and ``bce`` (float
    targets of the output's shape) with ``n``. None when the batch and outputs pair up as neither.
    Shapes are read on the host; no value is."""
    logits = logits_of(outputs)
    if logits is None or logits.dim() < 2:
        return None
    t = targets_of(batch)
    if t is not None:
        dim = class_dim(logits, t)
        if dim is None or t.numel() == 0:
            return None
        scores = logits.detach().float() if dim == -1 else logits.detach().float().movedim(1, -1)
        ce, n = masked_ce(scores, t)
        out = {"ce": ce, "n": n}
        if scores.dim() == 3 and scores.shape[1] > 1:  # (B, T, C): the target of position t is token t+1
            out["ce_shift"] = masked_ce(scores[:, :-1], t[:, 1:])[0]
        return out
    y = pick(batch, None, TARGET_KEYS, 1)
    if isinstance(y, torch.Tensor) and y.is_floating_point() and y.numel() == logits.numel() > 1 and (
            y.shape == logits.shape or [d for d in y.shape if d != 1] == [d for d in logits.shape if d != 1]):
        # (B,) targets beside (B, 1) predictions: the loop's MSE squeezes or unsqueezes one of them
        yf, out_f = y.detach().float().reshape(logits.shape), logits.detach().float()
        # and the binary cross-entropy of the same pair: per-pixel BCE on 0/1 targets (a PixelCNN, a binarised VAE)
        # can equal the logits' MSE at one step by chance (0.5648 vs 0.5622 at a PixelCNN's step 1)
        return {"mse": F.mse_loss(out_f, yf), "var": yf.var(unbiased=False), "n": (yf == yf).sum().float(),
                "bce": F.binary_cross_entropy_with_logits(out_f, yf)}
    return None


def per_position(batch: Any) -> bool:
    """Whether the batch's class targets are one per position (``(B, T)``: a language model), from shapes."""
    t = targets_of(batch)
    return t is not None and t.dim() >= 2 and t.shape[1] > 1


def _close(a: float, b: float, tol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def decide(loss: float, got: dict[str, float], classes: int, accumulated: bool = False, sequence: bool = False) -> Task:
    """The task one step shows: its ``loss`` against the host values of :func:`terms` (``classes``:
    the output's class count, from its shape)."""
    tol = TOL_ACCUM if accumulated else TOL
    n = got.get("n", 1.0)
    if "ce" in got:
        c = classes
        for shift, ce in ((False, got["ce"]), (True, got.get("ce_shift", math.nan))):
            for red, scale in (("mean", 1.0), ("sum", n)):
                if _close(loss, ce * scale, tol):
                    return Task("classification", math.log(c) * scale, c, red, shift, sequence)
        return Task()
    if "mse" in got:
        for red, scale in (("mean", 1.0), ("sum", n)):
            mse, bce = got["mse"] * scale, got.get("bce", math.nan) * scale
            if _close(loss, mse, tol) and not abs(loss - bce) <= abs(loss - mse):  # a nearer BCE: not a regression
                return Task("regression", got["var"] * scale, -1, red)
    return Task()


class Marginal:
    """The class frequencies of the targets over the first ``steps`` (20) steps, accumulated on the
    device (one ``bincount`` of the step's targets per step, then nothing): a model that ignores
    its input reaches the entropy of these frequencies, not ln C, when classes are imbalanced."""

    def __init__(self, steps: int = 20) -> None:
        self.steps, self.seen = steps, 0
        self.counts: torch.Tensor | None = None
        self.done = False

    @torch.no_grad()
    def add(self, outputs: Any, batch: Any) -> None:
        if self.done or self.seen >= self.steps:
            return
        logits, t = logits_of(outputs), targets_of(batch)
        dim = class_dim(logits, t) if logits is not None and t is not None else None
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

    def take(self) -> torch.Tensor | None:
        """The counts once ``steps`` steps were seen (once), else None."""
        if self.done or self.seen < self.steps or self.counts is None:
            return None
        self.done = True
        return self.counts


def entropy(counts: Any) -> tuple[float, float]:
    """The Miller-Madow entropy (nats) of class ``counts`` and the largest class's share."""
    import numpy as np

    n = float(np.sum(counts))
    if n <= 0:
        return math.nan, math.nan
    p = np.asarray(counts, dtype=np.float64) / n
    nz = p[p > 0]
    return float(-(nz * np.log(nz)).sum() + (len(nz) - 1) / (2 * n)), float(p.max())

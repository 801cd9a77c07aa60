"""Which task the loss measures, shown rather than guessed from the batch's shapes.

A batch ``(x, y)`` with integer ``y`` and an output whose shape pairs with it looks like a
classification, but a VAE's 784-wide reconstruction next to unused digit labels looks the same, and
a language model shifts its labels inside ``forward``. So task-specific rules (chance level,
single-class collapse, label leak, pre-flight fitting) run only once the task is *shown*: at one of
the first steps, the loss the user passed equals the cross-entropy of the outputs against the
targets (mean or summed over the targets, padding ignored; the targets shifted by one position as
a language model does, or not), or the mean squared error against float targets of the output's
shape (a regression, whose chance level is the targets' variance) and not, closer, their binary
cross-entropy; or the binary cross-entropy (on logits, or on probabilities) against 0/1 targets of the
output's size: a binary or multi-label classification (``binary``), whose chance level is the entropy of
the label prior, H(p) (ln 2 at p = 0.5), the mean of H(p_j) over the labels of a multi-hot target. The
targets are ``batch[1]`` (or a target key); for a pair or triplet batch ``(x1, x2, y)`` whose second part
does not pair with the output, its last part. Integer 0/1 targets count (the loop casts them). Class targets that are
the integer model input shifted by one position (``(T, B)`` or ``(B, T)`` token ids, the targets as they are or
flattened to ``(T*B,)`` beside ``(T*B, C)`` outputs, as pytorch/examples' word_language_model does) show a language
model (``next_token``) whatever the layout.

Cost: on the first ``STEPS`` steps only, one cross-entropy (or MSE and two BCEs and the label prior) of the
step's outputs, on the device, kept by reference and read with the logging step's one host copy; nothing afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from trackdiag.util.tensors import TARGET_KEYS, class_dim, inputs_of, logits_of, pick, targets_of

STEPS = 3  # the first steps whose loss is compared with the outputs' cross-entropy / MSE
TOL = 0.02  # relative: an autocast loss and our fp32 recomputation agree to ~1e-3
TOL_ACCUM = 0.35  # several backward passes in the step: the loss is over micro-batches, the outputs the last one's
NEXT_TOKEN = 0.9  # the share of positions whose target is the input's next token from which the task is a language model


@dataclass
class Task:
    """``kind``: ``classification`` | ``binary`` | ``regression`` | ``unknown``; ``chance``: the loss a
    model that ignores its input gets (ln C for C classes, ln 2 for BCE, the targets' variance for MSE;
    times the number of targets for a summed loss); ``classes``; ``reduction`` (``mean`` | ``sum``);
    ``shift``: the loss compares position t with target t+1 (a causal language model shifting its
    labels); ``prior`` and ``majority`` (``binary`` only): the entropy of the label prior (mean over
    labels) and the majority label's mean share, from the step that showed the task."""

    kind: str = "unknown"
    chance: float = math.nan
    classes: int = -1
    reduction: str = "mean"
    shift: bool = False
    sequence: bool = False  # one target per position (a language model), not per sample
    prior: float = math.nan
    majority: float = math.nan
    soft: bool = False  # soft targets (mixup, label smoothing): ``chance`` is the mean target's entropy
    next_token: bool = False  # the targets are the input tokens shifted by one position: a language model


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
    the non-padding targets) with ``n`` (their count); or ``mse``, ``var`` (float targets of the output's
    shape) and the binary terms (:func:`_binary_terms`: ``bce``, ``bce_p``, ``binary``, ``prior``,
    ``majority``, ``n``; integer targets of the output's size get only these). None when the batch and
    outputs pair up as neither. Shapes are read on the host; no value is."""
    logits = logits_of(outputs)
    if logits is None or logits.numel() < 2:
        return None
    t = targets_of(batch)
    if t is not None:
        dim = class_dim(logits, t)
        if t.numel() == logits.numel() and (dim is None or logits.shape[dim] == 1):
            # integer targets of the output's size ((B,) or (B, 1) scores, multi-hot (B, L)): a BCE the loop casts
            return _binary_terms(logits, t)
        if dim is None or t.numel() == 0 or logits.dim() < 2:
            return None
        scores = logits.detach().float() if dim == -1 else logits.detach().float().movedim(1, -1)
        ce, n = masked_ce(scores, t)
        out = {"ce": ce, "n": n, **_agreement(scores, t)}
        if scores.dim() == 3 and scores.shape[1] > 1:  # (B, T, C): the target of position t is token t+1
            out["ce_shift"] = masked_ce(scores[:, :-1], t[:, 1:])[0]
        following = next_token_share(inputs_of(batch), t)
        if following is not None:
            out["next"] = following
        return out
    y = _float_target(batch, logits)
    if y is not None and y.is_floating_point() and y.shape == logits.shape and logits.dim() == 2 and logits.shape[1] > 1:
        soft = _soft_terms(logits, y)  # (B, C) soft targets: mixup, label smoothing, a teacher's probabilities
        if soft is not None:
            return soft
    if y is not None and (not y.is_floating_point() or y is not pick(batch, None, TARGET_KEYS, 1)):
        # a pair/triplet batch's last part: read as a BCE's labels only (an MSE on it, a click model's, shows
        # a regression whose chance, the clicks' variance, a slow SGD run sits near for 100 steps and learns)
        return _binary_terms(logits, y)
    if y is not None:
        # (B,) targets beside (B, 1) predictions: the loop's MSE squeezes or unsqueezes one of them
        yf, out_f = y.detach().float().reshape(logits.shape), logits.detach().float()
        # and the binary cross-entropy of the same pair: per-pixel BCE on 0/1 targets (a PixelCNN, a binarised VAE)
        # can equal the logits' MSE at one step by chance (0.5648 vs 0.5622 at a PixelCNN's step 1)
        return {"mse": F.mse_loss(out_f, yf), "var": yf.var(unbiased=False), **_binary_terms(out_f, yf)}
    return None


def next_token_share(x: Any, t: torch.Tensor) -> torch.Tensor | None:
    """The share of positions whose class target is the next token of the integer input ``x`` along its sequence
    axis, the first (``(T, B)``, seq-first) or the second (``(B, T)``), ``t`` as it is or flattened (0-d float, on the
    device); None when ``x`` is no 2-D integer tensor of ``t``'s size."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.numel() != t.numel() or min(x.shape) < 2 \
            or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool or x.device != t.device:
        return None
    tv = t.reshape(x.shape)
    return torch.maximum((tv[:-1] == x[1:]).float().mean(), (tv[:, :-1] == x[:, 1:]).float().mean())


def _agreement(scores: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``agree``: the share of the (non-padding) class targets equal to the outputs' own prediction (argmax);
    ``spread``: how far apart the predicted classes are (0: one class predicted everywhere). A model at its start
    agrees with real labels about as often as chance; one whose targets were computed from its outputs (``y =
    out.argmax(1)``) agrees on every one (``targets_from_outputs``)."""
    c = scores.shape[-1]
    pred = scores.argmax(-1)
    valid = (t >= 0) & (t < c)
    agree = (valid & (pred == t)).sum() / valid.sum().clamp_min(1)
    return {"agree": agree.float(), "spread": (pred.max() - pred.min()).float()}


def _soft_terms(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """Device scalars of a soft-target cross-entropy reading of ``(logits, y)`` (both ``(B, C)``): ``soft_ce``
    (``-sum y log_softmax(logits)``, mean over rows), ``soft_h``: the entropy of the mean target row (what a
    model that ignores its input scores: the best constant prediction is the mean target), ``soft`` (1 when
    every row is a distribution), the MSE/BCE terms of the same pair (a regression on (B, C) targets that sum to
    one stays a regression when its loss is the MSE), and ``n``."""
    yf, out_f = y.detach().float(), logits.detach().float()
    mean = yf.mean(0).clamp_min(0.0)
    ok = ((yf >= 0).all() & ((yf.sum(1) - 1).abs() < 1e-3).all()).float()
    return {"soft_ce": -(yf * F.log_softmax(out_f, dim=-1)).sum(-1).mean(), "soft_h": -torch.xlogy(mean, mean).sum(),
            "soft": ok, "rows": yf.new_tensor(float(yf.shape[0])), "mse": F.mse_loss(out_f, yf), "var": yf.var(unbiased=False), **_binary_terms(out_f, yf)}


def _float_target(batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
    """The batch's float targets of the output's size: ``batch[1]`` (or a target key), else the last part
    of a pair/triplet batch ``(x1, x2, y)`` (float or integer labels); None when neither pairs with the output."""
    cands = [pick(batch, None, TARGET_KEYS, 1)]
    if isinstance(batch, (list, tuple)) and len(batch) > 2:
        cands.append(batch[-1])
    for i, y in enumerate(cands):
        if isinstance(y, torch.Tensor) and (y.is_floating_point() or i > 0) and y.numel() == logits.numel() > 1 and (
                y.shape == logits.shape or [d for d in y.shape if d != 1] == [d for d in logits.shape if d != 1]):
            return y
    return None


def _binary_terms(logits: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Device scalars of a binary/multi-label reading of ``(logits, y)`` (same size): ``bce`` (on logits),
    ``bce_p`` (on probabilities, clamped as torch's BCE clamps its logs), ``binary`` (1 when every target is
    0 or 1), ``prior``: the mean over labels (the target's non-batch positions) of the Miller-Madow entropy of
    each label's 0/1 frequencies in the batch, ``majority``: the mean majority share, and ``n``."""
    out_f, yf = logits.detach().float().reshape(-1), y.detach().float().reshape(-1)
    rows = y.shape[0] if y.dim() >= 1 and y.shape[0] > 1 else yf.numel()
    cols = yf.reshape(rows, -1)  # (batch, labels); a 1-D target is one label
    p = cols.mean(0).clamp(0.0, 1.0)
    h = -(torch.xlogy(p, p) + torch.xlogy(1 - p, 1 - p))
    h = h + ((p > 0) & (p < 1)).float() / (2 * rows)  # Miller-Madow: one batch's frequencies read low
    prob = out_f.clamp(1e-7, 1 - 1e-7)
    return {"bce": F.binary_cross_entropy_with_logits(out_f, yf),
            "bce_p": -(torch.xlogy(yf, prob) + torch.xlogy(1 - yf, 1 - prob)).mean(),
            "binary": ((yf == 0) | (yf == 1)).all().float(), "prior": h.mean(),
            "majority": torch.maximum(p, 1 - p).mean(), "n": (yf == yf).sum().float()}


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
        lm = got.get("next", 0.0) >= NEXT_TOKEN  # flattened or not: position t's target is input token t+1
        for shift, ce in ((False, got["ce"]), (True, got.get("ce_shift", math.nan))):
            for red, scale in (("mean", 1.0), ("sum", n)):
                if _close(loss, ce * scale, tol):
                    return Task("classification", math.log(c) * scale, c, red, shift, sequence or lm, next_token=lm)
        return Task()
    if got.get("soft") == 1.0:
        for red, scale in (("mean", 1.0), ("sum", got.get("rows", 1.0))):
            if _close(loss, got["soft_ce"] * scale, tol):  # soft-target CE: chance is the mean target's entropy
                return Task("classification", got["soft_h"] * scale, classes, red, soft=True)
    if got.get("binary") == 1.0:
        for red, scale in (("mean", 1.0), ("sum", n)):
            mse = got.get("mse", math.nan) * scale
            for bce in (got["bce"] * scale, got["bce_p"] * scale):
                if _close(loss, bce, tol) and not abs(loss - mse) < abs(loss - bce):
                    return Task("binary", math.log(2) * scale, 2, red, prior=got["prior"], majority=got["majority"])
    if "mse" in got:
        for red, scale in (("mean", 1.0), ("sum", n)):
            mse, bce = got["mse"] * scale, got.get("bce", math.nan) * scale
            if _close(loss, mse, tol) and not abs(loss - bce) <= abs(loss - mse):  # a nearer BCE: not a regression
                return Task("regression", got["var"] * scale, -1, red)
    return Task()

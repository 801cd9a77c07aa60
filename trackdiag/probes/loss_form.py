"""``loss_form``: a classification loss given the wrong form of scores: cross-entropy on probabilities (a softmax
already applied: ``nn.Softmax`` at the end of the model, then ``nn.CrossEntropyLoss``, which applies its own), and
``nll_loss`` on scores that are not log-probabilities (raw logits, or probabilities: ``log_softmax`` forgotten).

Neither crashes. Cross-entropy on probabilities squeezes every logit into [0, 1]: the loss cannot fall below
``log(1 + (C - 1) / e)`` (1.46 for 10 classes) and the gradients shrink by the softmax's slope, so a model that should
reach ~0 stalls high. ``nll_loss`` on raw scores is minimised by growing the target's score without bound (the loss
runs below zero); on probabilities it saturates at -1.

The probe reads the class scores and integer targets handed to ``step(loss, outputs=..., batch=...)`` (the shapes
``data_labels`` pairs: ``(N, C)`` with ``(N,)``, ``(B, T, C)`` with ``(B, T)``, ``(N, C, H, W)`` with ``(N, H, W)``;
options ``target`` and ``output`` as there). On at most ``checks`` (3) steps of the first ``steps`` (200), one per
logging window, it computes in float64 the cross-entropy and the negative log-likelihood of those scores as they
are (targets outside ``[0, C)``, padding included, left out as ``ignore_index`` leaves them; no index is read out
of range), how far the score rows are from a probability simplex and from log-probabilities, beside the step's
loss. The rules compare them on the host: a loop that computes its loss from other tensors, with class weights or
label smoothing, matches neither and is never judged.

Emits ``diag/data/loss_form_checks`` at every logging step and, after a measured step, the table
``diag/data/loss_form``: ``step``, ``loss``, ``ce`` and ``nll`` (means over the counted targets), ``ce_softmax`` (the
cross-entropy of the scores' softmax: the loss of a softmax applied in the loss line), ``nll_softmax`` (their NLL: a
softmax, not a log-softmax, in the loss line before ``nll_loss``), ``ce_sigmoid`` (the cross-entropy of the scores'
sigmoid: a sigmoid in the loss line), ``classes`` (C), ``targets`` (their number), ``simplex`` (the largest distance of a row's sum from 1; negative scores make it large: ``min`` is kept
too), ``min`` (the smallest score), ``logsumexp`` (the mean absolute log-sum-exp of the rows: 0 for
log-probabilities), ``eps`` (the loss dtype's machine epsilon).

Sequence targets ``(B, T)`` against scores ``(B, T, C)`` (``padding_in_loss``): the value most rows end with, where it
runs to the end of its rows, is padding; the table then also holds ``pad_share`` (the positions it fills),
``pad_suffix`` (the rows where it is a suffix), ``pad_inputs`` (the share of them where an integer input of the batch
holds its own end value, aligned or shifted by one; -1 without one), ``pad_value`` and ``ce_unpadded`` (the
cross-entropy without those positions). A loss equal to ``ce`` and not to ``ce_unpadded`` counts the padding.

The binary and multi-label case (``sigmoid_before_bce``): targets with as many values as the scores, and
scores that come out of a sigmoid (the output's autograd node, through view-like ops, is ``SigmoidBackward0``: an
``nn.Sigmoid`` at the end of the model or ``torch.sigmoid``), or raw scores, then taken through one (a
``torch.sigmoid`` in the loss line). On such a step the probe computes the binary
cross-entropy of those probabilities taken as logits (``BCEWithLogitsLoss``'s) and as probabilities (``BCELoss``'s)
beside the step's loss: the table ``diag/data/bce_form`` holds ``step``, ``loss``, ``with_logits``, ``plain``, ``targets``,
``min``, ``max``, ``eps`` and ``raw`` (1: raw scores taken through a sigmoid here). A sigmoid before ``BCEWithLogitsLoss`` squeezes every logit into (0, 1): the model
predicts probabilities in (0.5, 0.73) only, every sample positive, and the loss cannot fall below ``log(1 + e^-1)``.

Cost: host checks per step for the first ``steps`` steps; ~12 device ops on at most ``checks`` steps, over a float64
copy of the scores: scores of more than ``MAX_ELEMENTS`` (16.8M: a large-vocabulary LM's) are not checked.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.tensors import TARGET_KEYS, class_dim, logits_of, pick, targets_of

MAX_ELEMENTS = 1 << 24  # scores copied to float64 once per check: at most 128 MB (a large-vocabulary LM's are not checked)


class LossFormProbe(Probe):
    """See module docstring. Args: ``target`` / ``output`` as for ``data_labels``; ``steps`` how many steps to look,
    ``checks`` how many steps to measure."""

    name = "loss_form"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, target: int | str | None = None,
                 output: int | str | None = None, steps: int = 200, checks: int = 3) -> None:
        super().__init__(enabled=enabled, every=every)
        self.target, self.output, self.steps, self.checks = target, output, steps, checks
        self._measured = 0
        self._held: tuple[int, torch.Tensor, float] | None = None
        self._taken: tuple[int, float, bool] | None = None
        self._binary_held = False  # the held values are the binary case's (measure_binary)
        self._binary_raw = False  # ... of raw scores, taken through a sigmoid here
        #: a softmax over a non-class dimension: (its dim, made the outputs, the class dim, the two sizes)
        self._wrong: tuple[int, bool, int, int, int] | None = None
        #: the values appended to ``measure``'s, the activation code, the number of classes
        self._extras: tuple[list[str], float, int] = ([], 0.0, 0)

    def quiet(self, ctx: ProbeContext) -> bool:
        return self._measured >= self.checks or ctx.step >= self.steps

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._held is not None or self._measured >= self.checks or ctx.step >= self.steps \
                or inputs.outputs is None or inputs.batch is None or len(inputs.losses) != 1:  # quiet(), inline
            return
        loss = next(iter(inputs.losses.values()))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            return
        t = targets_of(inputs.batch, self.target)
        z = logits_of(inputs.outputs, self.output) if t is not None else None
        dim = class_dim(z, t) if z is not None and t is not None else None
        if dim is None or z is None or t is None or t.numel() == 0 or z.shape[dim] < 2 or z.device != t.device \
                or z.numel() > MAX_ELEMENTS:
            self._binary(ctx, inputs, loss)  # not class scores against class targets: perhaps a binary loss
            return
        found = softmax_dim(loss, z, dim)
        wrong = None if found is None else (*found, dim % z.dim(), z.shape[found[0]], z.shape[dim])
        act = made_by(z)
        extras: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            values = measure(z, t, dim, loss)
            if wrong is not None:  # a softmax over another dimension: the cross-entropy along it, beside
                extras["along"] = along(z, t, dim, wrong[0])
            # the cross-entropy of the scores' softmax: the loss's when a softmax sits between the outputs handed over
            # and the cross-entropy (``F.cross_entropy(F.softmax(logits, 1), y)`` in the loss line)
            # and its NLL (``F.nll_loss(F.softmax(logits, 1), y)``: log_softmax meant), and the cross-entropy of the
            # scores' sigmoid (``F.cross_entropy(torch.sigmoid(logits), y)``)
            wide = z.detach().to(_wide(z))
            soft = measure(wide.softmax(dim), t, dim, loss)
            extras["ce_softmax"], extras["nll_softmax"] = soft[1], soft[2]
            extras["ce_sigmoid"] = measure(wide.sigmoid(), t, dim, loss)[1]
            pad = padding(z, t, dim, inputs.batch)
            if pad is not None:  # trailing padding in the targets: the cross-entropy without it, and its evidence
                extras.update(zip(("pad_share", "pad_suffix", "pad_inputs", "pad_value", "ce_unpadded"), pad))
            if act in ACTIVATIONS:  # a bounding activation made the scores: how many sit at its floor, its top
                extras["at_zero"] = (z == 0).to(values.dtype).mean()
                extras["max"] = z.detach().max()
            if extras:
                values = torch.cat([values, *(v.to(values.dtype).reshape(1) for v in extras.values())])
        self._measured += 1
        self._held = (ctx.step, values, float(torch.finfo(loss.dtype).eps))
        self._wrong = wrong
        self._extras = (list(extras), ACTIVATIONS.get(act or "", 0.0), z.shape[dim])

    def _binary(self, ctx: ProbeContext, inputs: StepInputs, loss: torch.Tensor) -> None:
        """A binary or multi-label loss: measured only when the scores come out of a sigmoid (see module docstring)."""
        t = pick(inputs.batch, self.target, TARGET_KEYS, 1)
        z = logits_of(inputs.outputs, self.output)
        if not isinstance(t, torch.Tensor) or z is None or t.is_complex() or t.numel() != z.numel() \
                or z.numel() == 0 or z.numel() > MAX_ELEMENTS or z.device != t.device:
            return
        with torch.no_grad():
            # scores out of a sigmoid as they are; raw scores through one: BCEWithLogitsLoss(torch.sigmoid(logits)) in
            # the loss line gives the loss of the first
            raw = not from_sigmoid(z)
            values = measure_binary(z.detach().to(_wide(z)).sigmoid() if raw else z, t, loss)
        self._measured += 1
        self._held = (ctx.step, values, float(torch.finfo(loss.dtype).eps))
        self._binary_held = True
        self._binary_raw = raw

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        out: dict[str, torch.Tensor | float] = {"checks": float(self._measured)}
        self._taken = None
        if self._held is not None:
            step, values, eps = self._held
            self._held, self._taken = None, (step, eps, self._binary_held)
            self._binary_held = False
            out["values"] = values
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        record.scalars["diag/data/loss_form_checks"] = float(self._measured)
        got = values.get("values")
        if got is None or self._taken is None:
            return
        step, eps, binary = self._taken
        if binary:
            loss, logits, plain, n, low, high = (float(v) for v in got.reshape(-1))
            if math.isfinite(loss) and n > 0:
                record.tables["diag/data/bce_form"] = {"step": float(step), "loss": loss, "with_logits": logits,
                                                       "plain": plain, "targets": n, "min": low, "max": high, "eps": eps,
                                                       "raw": float(self._binary_raw)}
            return
        loss, ce, nll, n, simplex, low, lse, *rest = (float(v) for v in got.reshape(-1))
        if math.isfinite(loss) and n > 0:
            table = record.tables["diag/data/loss_form"] = {"step": float(step), "loss": loss, "ce": ce, "nll": nll,
                                                            "targets": n, "simplex": simplex, "min": low,
                                                            "logsumexp": lse, "eps": eps}
            names, act, classes = self._extras
            extra = dict(zip(names, rest))
            table["classes"] = float(classes)
            if act:
                table.update(activation=act, at_zero=extra.get("at_zero", math.nan), max=extra.get("max", math.nan),
                             classes=float(classes))
            if "ce_unpadded" in extra:
                table.update({k: extra[k] for k in ("pad_share", "pad_suffix", "pad_inputs", "pad_value", "ce_unpadded")})
            table.update({k: extra[k] for k in ("ce_softmax", "nll_softmax", "ce_sigmoid") if k in extra})
            if "along" in extra and self._wrong is not None:
                d, made, cdim, size, classes = self._wrong
                table.update(softmax_dim=float(d), along=extra["along"], softmax_output=float(made),
                             class_dim=float(cdim), dim_size=float(size), classes=float(classes))
        self._wrong, self._extras = None, ([], 0.0, 0)


def _wide(z: torch.Tensor) -> torch.dtype:
    """float64 where the device has it (the recomputed losses exact beside the loss's own rounding), else float32."""
    return torch.float64 if z.device.type in ("cpu", "cuda") else torch.float32


def measure(z: torch.Tensor, t: torch.Tensor, dim: int, loss: torch.Tensor) -> torch.Tensor:
    """``[loss, CE, NLL, counted targets, max |row sum - 1|, min score, mean |row logsumexp|]``, one device vector
    (float64 where the device has it: beside the loss's own rounding the recomputed values are exact)."""
    wide = _wide(z)
    c = z.shape[dim]
    rows = z.detach().to(wide).movedim(dim, -1).reshape(-1, c)
    flat = t.reshape(-1)
    counted = (flat >= 0) & (flat < c)
    picked = rows.gather(1, flat.clamp(0, c - 1).unsqueeze(1)).squeeze(1)
    lse = torch.logsumexp(rows, 1)
    n = counted.sum()
    keep = counted.to(wide)
    denom = n.clamp(min=1).to(wide)
    return torch.stack([loss.detach().to(wide).reshape(()), ((lse - picked) * keep).sum() / denom,
                        (-picked * keep).sum() / denom, n.to(wide), (rows.sum(1) - 1).abs().max(), rows.min(),
                        lse.abs().mean()])


def padding(z: torch.Tensor, t: torch.Tensor, dim: int, batch: Any) -> list[torch.Tensor] | None:
    """Trailing padding in sequence targets ``t`` ``(B, T)`` (scores ``(B, T, C)``): the value ``v`` most rows end with
    (a class index: a negative or out-of-range one is left out by the loss already), and as device scalars ``[share of
    positions holding v, share of rows where v is a suffix (no v before a non-v), share of those positions where an
    integer input of the batch of the same length holds its own end value (aligned at the start or shifted by one:
    -1 without such an input), v, the cross-entropy over the counted targets other than v]``. None for other shapes."""
    if t.dim() != 2 or t.shape[1] < 4 or t.is_floating_point() or z.dim() != 3 or dim % 3 != 2:
        return None
    wide = _wide(z)
    c = z.shape[dim]
    v = t[:, -1].mode().values
    pad = t == v
    share = pad.to(wide).mean()
    suffix = (pad[:, :-1] <= pad[:, 1:]).all(1).to(wide).mean()  # once padding starts, it runs to the end
    inputs = -torch.ones((), dtype=wide, device=t.device)
    parts = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    x = next((a for a in parts if isinstance(a, torch.Tensor)
              and a is not t and a.dim() == 2 and not a.is_floating_point() and a.shape[0] == t.shape[0]
              and abs(a.shape[1] - t.shape[1]) <= 1 and a.device == t.device), None)
    if x is not None:
        xp = x == x[:, -1].mode().values
        n = min(xp.shape[1], pad.shape[1])
        same = (xp[:, :n] & pad[:, :n]).sum().to(wide) / pad[:, :n].sum().clamp(min=1).to(wide)
        # decoder inputs shifted right (the targets one position ahead): the target's last column has no input after it
        shifted = (xp[:, 1:n] & pad[:, :n - 1]).sum().to(wide) / pad[:, :n - 1].sum().clamp(min=1).to(wide)
        inputs = torch.maximum(same, shifted)
    rows = z.detach().to(wide).reshape(-1, c)
    flat = t.reshape(-1)
    counted = (flat >= 0) & (flat < c) & (flat != v)
    picked = rows.gather(1, flat.clamp(0, c - 1).unsqueeze(1)).squeeze(1)
    keep = counted.to(wide)
    ce = ((torch.logsumexp(rows, 1) - picked) * keep).sum() / keep.sum().clamp(min=1)
    return [share, suffix, inputs, v.to(wide), ce]


_SOFTMAX = frozenset({"SoftmaxBackward0", "LogSoftmaxBackward0"})
_SAME_SHAPE = frozenset({"CloneBackward0", "ToCopyBackward0", "AliasBackward0"})  # ops that keep every dimension


def softmax_dim(loss: torch.Tensor, z: torch.Tensor, cdim: int, depth: int = 5, budget: int = 24) -> tuple[int, bool] | None:
    """``(dim, made_outputs)`` of a softmax or log-softmax over a dimension other than the class dimension ``cdim`` of
    the scores ``z``: ``z`` is its result (``made_outputs``: an ``nn.Softmax(dim=0)`` at the end of the model), or it
    takes ``z`` itself (a copy or a dtype cast at most) and lies within ``depth`` autograd nodes of the loss
    (``F.log_softmax(logits, dim=0)`` in the loss). None when there is none. Host only, after the backward pass (the
    nodes' saved tensors are freed by then; their ``dim`` is kept): a walk over at most ``budget`` nodes."""
    cdim %= z.dim()
    made = z.grad_fn

    def wrong(fn: object) -> int | None:
        if type(fn).__name__ not in _SOFTMAX:
            return None
        d = getattr(fn, "_saved_dim", None)
        if not isinstance(d, int):
            return None
        d = (d - (1 << 64) if d >= 1 << 63 else d) % z.dim()  # saved as unsigned: -1 reads 2**64 - 1
        return d if d != cdim and z.shape[d] > 1 else None

    def takes_z(fn: Any) -> bool:  # the softmax's input is ``z`` as it is (a reshape or a transpose renumbers dims)
        for _ in range(3):
            fn = next((f for f, _ in fn.next_functions if f is not None), None)
            if fn is None or fn is made:
                return fn is made and made is not None
            if type(fn).__name__ not in _SAME_SHAPE:
                return False
        return False

    try:
        d = wrong(made) if made is not None else None
        if d is not None:
            return d, True
        frontier, seen = [loss.grad_fn], 0
        for _ in range(depth):
            nxt = []
            for fn in frontier:
                if fn is None or seen >= budget:
                    continue
                seen += 1
                d = wrong(fn)
                if d is not None and takes_z(fn):
                    return d, False
                nxt.extend(f for f, _ in fn.next_functions)
            frontier = nxt
    except (RuntimeError, AttributeError):  # a node type that keeps nothing readable: not judged
        return None
    return None


def along(z: torch.Tensor, t: torch.Tensor, cdim: int, dim: int) -> torch.Tensor:
    """The mean cross-entropy of ``z`` normalised along ``dim`` (not the class dimension ``cdim``), the target picked
    along ``cdim``; targets outside ``[0, C)`` left out (float64 where the device has it)."""
    wide = _wide(z)
    zz = z.detach().to(wide)
    c = z.shape[cdim]
    rows = (zz.logsumexp(dim, keepdim=True) - zz).movedim(cdim, -1).reshape(-1, c)
    flat = t.reshape(-1)
    counted = (flat >= 0) & (flat < c)
    picked = rows.gather(1, flat.clamp(0, c - 1).unsqueeze(1)).squeeze(1)
    return (picked * counted.to(wide)).sum() / counted.sum().clamp(min=1).to(wide)


#: autograd nodes that only reshape or view their input: looked through to the op that made the scores
_VIEWS = frozenset({"SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "ViewBackward0",
                    "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0", "CloneBackward0",
                    "ToCopyBackward0", "TBackward0", "PermuteBackward0", "SelectBackward0", "SliceBackward0"})


#: activations that bound the class scores they make, by the code the table ``diag/data/loss_form`` gives them
ACTIVATIONS = {"sigmoid": 1.0, "relu": 2.0, "tanh": 3.0}
_MADE_BY = {"SigmoidBackward0": "sigmoid", "ReluBackward0": "relu", "TanhBackward0": "tanh"}


def made_by(z: torch.Tensor, depth: int = 6) -> str | None:
    """The op that made ``z``, seen through up to ``depth`` view-like autograd nodes: ``sigmoid``, ``relu`` or ``tanh``
    for those, else None (host only)."""
    fn = z.grad_fn
    for _ in range(depth):
        if fn is None:
            return None
        name = type(fn).__name__
        if name in _MADE_BY:
            return _MADE_BY[name]
        if name not in _VIEWS:
            return None
        fn = next((f for f, _ in fn.next_functions if f is not None), None)
    return None


def from_sigmoid(z: torch.Tensor, depth: int = 6) -> bool:
    """Whether ``z`` was made by a sigmoid, seen through up to ``depth`` view-like autograd nodes (host only)."""
    return made_by(z, depth) == "sigmoid"


def measure_binary(z: torch.Tensor, t: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``[loss, BCE of the scores as logits, BCE of the scores as probabilities, targets, min score, max score]``, one
    device vector in float64 where the device has it (``BCELoss``'s own log clamp at -100 kept)."""
    wide = _wide(z)
    zz, tt = z.detach().to(wide).reshape(-1), t.detach().to(wide).reshape(-1)
    with_logits = torch.nn.functional.binary_cross_entropy_with_logits(zz, tt)
    # targets outside [0, 1] (a regression's) are no BCELoss's: clamped, so that the op cannot assert on the device
    plain = torch.nn.functional.binary_cross_entropy(zz.clamp(0.0, 1.0), tt.clamp(0.0, 1.0))
    return torch.stack([loss.detach().to(wide).reshape(()), with_logits, plain, zz.new_tensor(float(zz.numel())),
                        zz.min(), zz.max()])

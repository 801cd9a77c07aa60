"""``softmax_before_ce``, ``nll_without_log_softmax``, ``sigmoid_before_bce``: a classification loss given the wrong
form of scores (keys of the ``loss_form`` probe: its tables hold the step's loss beside the cross-entropy and the NLL
of the scores handed to ``step()``, and how far those are from probabilities and from log-probabilities; for scores
made by a sigmoid, beside their binary cross-entropy as logits and as probabilities)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule
from trackdiag.util.stats import rounding_tolerance

TABLE = "diag/data/loss_form"
BINARY = "diag/data/bce_form"


def matches(loss: float, value: float, count: float, eps: float) -> bool:
    """Whether ``loss`` is ``value`` (a mean over ``count`` targets) or its sum, to within 64 ulps of the loss's
    dtype (the probe recomputes in float64: the loss's own rounding is all there is to allow for)."""
    for v in (value, value * count):
        if math.isfinite(v) and abs(loss - v) <= rounding_tolerance(loss, v, eps):
            return True
    return False


def in_loss_line(table: dict[str, float], key: str) -> bool:
    """The step's loss is ``table[key]`` (a value recomputed through an activation in the loss line) and neither the
    cross-entropy nor the NLL of the scores as handed over."""
    n, eps, loss = table["targets"], table["eps"], table["loss"]
    return (matches(loss, table.get(key, math.nan), n, eps) and not matches(loss, table["ce"], n, eps)
            and not matches(loss, table["nll"], n, eps))


def nearer(loss: float, key: str, other: str, table: dict[str, float]) -> bool:
    """Whether ``loss`` is nearer ``table[key]`` than ``table[other]`` (True without the other): near initialisation
    the cross-entropies of a softmax and of a sigmoid of the same scores are both ~log C, within the loss's rounding of
    each other at some steps, and the one the loss line computed is the nearer."""
    theirs = table.get(other, math.nan)
    return not math.isfinite(theirs) or abs(loss - table[key]) < abs(loss - theirs)


class _Once(Rule):
    """Fires once per run, at the measured step (the scores' form is the model's and the loss's, from the start).

    A finding that ``needs_twice`` is raised only when the next measured step finds it too, at the first one's step:
    the loss matched a value recomputed through an activation (a softmax, a sigmoid in the loss line), which at
    initialisation is nearly the same for any scores (``log C`` for a near-uniform softmax), so an unrelated loss near
    it (label smoothing, class weights, the mean of accumulated micro-batches beside the last one's scores) can match
    it once by chance. The loss of that activation matches it at every step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fired = False
        self._pending: dict[str, float] | None = None  # a finding that needs_twice, seen once

    def found(self, table: dict[str, float]) -> bool:  # noqa: D102 - see subclasses
        raise NotImplementedError

    def say(self, table: dict[str, float]) -> str:  # noqa: D102 - see subclasses
        raise NotImplementedError

    def needs_twice(self, table: dict[str, float]) -> bool:
        """Whether this finding must be seen at two measured steps in a row (see the class docstring)."""
        return False

    table, reference = TABLE, "ce"  # the probe's table this rule reads, and the value its alerts give as threshold

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        table = record.tables.get(self.table)
        if self._fired or not table:
            return []
        if not self.found(table):
            self._pending = None  # the loss of that activation would have matched again
            return []
        if self.needs_twice(table) and self._pending is None:
            self._pending = dict(table)
            return []
        first, self._pending, self._fired = self._pending or table, None, True
        return [self.make(int(first["step"]), self.say(first), first["loss"], first[self.reference], "loss",
                          ["unambiguous", "loss"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired, "pending": self._pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))
        self._pending = state.get("pending")


class SoftmaxBeforeCE(_Once):
    """The step's loss is the cross-entropy of scores that are probabilities (every row non-negative and summing to
    1): a softmax applied before ``CrossEntropyLoss``/``F.cross_entropy``, which applies its own. The loss cannot
    fall below ``log(1 + (C - 1) / e)`` and learning crawls. Critical (``unambiguous``, ``loss``)."""

    kind = "softmax_before_ce"
    hint = ("CrossEntropyLoss takes raw logits: remove the final nn.Softmax / F.softmax from the model (apply it only "
            "for predictions, e.g. probs = logits.softmax(-1) at evaluation), or use F.nll_loss(torch.log(probs)) if "
            "the model must output probabilities.")

    def found(self, table: dict[str, float]) -> bool:
        n, eps = table["targets"], table["eps"]
        if "softmax_dim" in table:
            return False
        if self._in_loss(table):
            return True
        return (table["min"] >= 0 and table["simplex"] <= 1e-3 and matches(table["loss"], table["ce"], n, eps)
                and not matches(table["loss"], table["nll"], n, eps))

    def needs_twice(self, table: dict[str, float]) -> bool:
        return self._in_loss(table)

    @staticmethod
    def _in_loss(table: dict[str, float]) -> bool:
        """The loss is the cross-entropy of the softmax of the (raw) scores handed over, not of the scores: the softmax
        sits between them and the cross-entropy, in the loss line."""
        return (not (table["min"] >= 0 and table["simplex"] <= 1e-3) and in_loss_line(table, "ce_softmax")
                and nearer(table["loss"], "ce_softmax", "ce_sigmoid", table))

    def say(self, table: dict[str, float]) -> str:
        if self._in_loss(table):
            return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the cross-entropy of the softmax of "
                    f"the outputs handed to step() (raw scores: {table['ce']:.4g} would be theirs): a softmax is applied "
                    f"between the model and the cross-entropy, which applies its own, so the loss cannot approach 0 and "
                    f"the gradients are flattened.")
        return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the cross-entropy of outputs that are "
                f"already probabilities (each row sums to 1): a softmax was applied before the cross-entropy, which "
                f"applies its own, so the loss cannot approach 0 and the gradients are flattened.")


class NllWithoutLogSoftmax(_Once):
    """The step's loss is ``nll_loss`` of scores that are not log-probabilities (their rows' log-sum-exp is not 0):
    raw logits, whose target score the loss grows without bound, or probabilities (the log forgotten). Critical
    (``unambiguous``, ``loss``)."""

    kind = "nll_without_log_softmax"
    hint = ("NLLLoss expects log-probabilities: apply F.log_softmax(logits, dim=1) before it, or pass the raw logits "
            "to F.cross_entropy instead (log_softmax and NLLLoss in one).")

    def found(self, table: dict[str, float]) -> bool:
        n, eps = table["targets"], table["eps"]
        return ((table["logsumexp"] > 1e-2 and matches(table["loss"], table["nll"], n, eps)
                 and not matches(table["loss"], table["ce"], n, eps) and "softmax_dim" not in table) or self._in_loss(table))

    def needs_twice(self, table: dict[str, float]) -> bool:
        return self._in_loss(table)

    @staticmethod
    def _in_loss(table: dict[str, float]) -> bool:
        """The loss is the NLL of the softmax of the raw scores handed over: a softmax, not a log-softmax, between
        them and ``nll_loss``, in the loss line."""
        return ("softmax_dim" not in table and not (table["min"] >= 0 and table["simplex"] <= 1e-3)
                and in_loss_line(table, "nll_softmax"))

    def say(self, table: dict[str, float]) -> str:
        if self._in_loss(table):
            return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the negative log-likelihood of the "
                    f"softmax of the outputs handed to step(): a softmax, not a log-softmax, sits between the model and "
                    f"NLLLoss, which expects log-probabilities. The loss is minus the target's probability: it saturates "
                    f"at -1 and gives a wrong prediction almost no gradient.")
        what = "probabilities" if table["min"] >= 0 and table["simplex"] <= 1e-3 else "raw scores"
        return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the negative log-likelihood of "
                f"outputs that are {what}, not log-probabilities (their rows' log-sum-exp averages "
                f"{table['logsumexp']:.3g}, 0 for log-probabilities): NLLLoss then rewards growing the target's score "
                f"without bound (raw scores) or saturates at -1 (probabilities).")


class ActivationBeforeCE(_Once):
    """The step's loss is the cross-entropy of class scores made by a bounding activation at the end of the model: a
    sigmoid or a tanh (every score squeezed into (0, 1) or (-1, 1): the softmax inside the cross-entropy can never be
    confident, the loss cannot fall below ``log(1 + (C - 1) e^-w)`` for a range of width ``w``) or a ReLU (no score below
    0: a score the ReLU zeroed gets no gradient, so a class can never be pushed down, and once zeroed for an input,
    never back up). The scores' autograd node, through views, is the activation's. Critical (``unambiguous``,
    ``loss``)."""

    kind = "activation_before_ce"
    hint = ("CrossEntropyLoss takes raw, unbounded logits: remove the final nn.Sigmoid / nn.ReLU / nn.Tanh from the "
            "model (the last layer should be the Linear). For multi-label targets (several classes per sample) use "
            "BCEWithLogitsLoss on the logits instead.")

    def found(self, table: dict[str, float]) -> bool:
        n, eps = table["targets"], table["eps"]
        return (table.get("activation", 0.0) > 0 and matches(table["loss"], table["ce"], n, eps)
                and not matches(table["loss"], table["nll"], n, eps)) or self._in_loss(table)

    def needs_twice(self, table: dict[str, float]) -> bool:
        return self._in_loss(table)

    @staticmethod
    def _in_loss(table: dict[str, float]) -> bool:
        """The loss is the cross-entropy of the sigmoid of the scores handed over (``F.cross_entropy(torch.sigmoid(
        logits), y)``): the sigmoid sits in the loss line."""
        return ("softmax_dim" not in table and table.get("activation", 0.0) == 0 and in_loss_line(table, "ce_sigmoid")
                and nearer(table["loss"], "ce_sigmoid", "ce_softmax", table))

    def say(self, table: dict[str, float]) -> str:
        if self._in_loss(table):
            c = int(table.get("classes", 0) or 0)
            floor = f" (log(1 + (C - 1) e^-1) = {math.log(1 + (c - 1) * math.exp(-1)):.3g} for {c} classes)" if c >= 2 else ""
            return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the cross-entropy of the sigmoid of "
                    f"the outputs handed to step(): a sigmoid sits between the model and the cross-entropy, so every "
                    f"score is squeezed into (0, 1), the softmax inside the cross-entropy can never be confident and the "
                    f"loss cannot fall far{floor}.")
        act, c = table["activation"], int(table["classes"])
        head = f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the cross-entropy of class scores that "
        if act == 2.0:
            return head + (f"come out of a ReLU: none can go below 0, and {table['at_zero']:.0%} of them are exactly 0 at "
                           f"that step. A zeroed score gets no gradient: its class cannot be pushed down for that input, "
                           f"nor come back up, so whole classes go unpredicted.")
        width, name, span = (1.0, "sigmoid", "(0, 1)") if act == 1.0 else (2.0, "tanh", "(-1, 1)")
        floor = math.log(1 + (c - 1) * math.exp(-width))
        return head + (f"come out of a {name}: every score is squeezed into {span}, so the softmax inside the "
                       f"cross-entropy can never be confident and the loss cannot fall below {floor:.3g} "
                       f"(log(1 + (C - 1) e^-{width:g}) for {c} classes).")


class SoftmaxWrongDim(_Once):
    """The step's loss is a classification loss of scores normalised along the wrong dimension: a softmax or
    log-softmax over the batch (``nn.Softmax(dim=0)``, ``F.log_softmax(logits, dim=0)``, or no ``dim`` on a 3-D
    ``(B, T, C)`` tensor, which picks 0) instead of over the classes. Each class's scores are normalised across the
    batch's samples: a sample's prediction depends on the others in its batch, the loss stalls far from 0, and the
    model still learns enough to hide it. Found when the scores handed to ``step`` are that softmax's result and the
    loss is their cross-entropy or NLL, or the softmax lies between the scores and the loss and the loss is the
    cross-entropy along its dimension (a symmetric contrastive loss, a mean over both dimensions, is not).
    Critical (``unambiguous``, ``loss``)."""

    kind = "softmax_wrong_dim"
    hint = ("Normalise over the classes: F.log_softmax(logits, dim=-1) (or dim=1 for (N, C, ...) scores), "
            "nn.Softmax(dim=-1); never call softmax/log_softmax without dim. Simplest: hand raw logits to "
            "F.cross_entropy, which normalises the right dimension itself.")
    reference = "along"

    def found(self, table: dict[str, float]) -> bool:
        if "softmax_dim" not in table:
            return False
        n, eps, loss = table["targets"], table["eps"], table["loss"]
        if matches(loss, table["along"], n, eps):
            return True
        return bool(table["softmax_output"]) and (matches(loss, table["ce"], n, eps) or matches(loss, table["nll"], n, eps))

    def say(self, table: dict[str, float]) -> str:
        d, c, size = int(table["softmax_dim"]), int(table["class_dim"]), int(table["dim_size"])
        what = "dimension 0 (the batch" if d == 0 else f"dimension {d} (size {size}"
        made = "the outputs handed to step() are a softmax" if table["softmax_output"] else "the loss applies a softmax"
        return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is computed from scores normalised over "
                f"{what}, {size} values), not over the {int(table['classes'])} classes (dimension {c}): {made} along "
                f"the wrong dimension. Each class's scores are shared out across the batch, so a sample's prediction "
                f"depends on the other samples and the loss cannot approach 0.")


class SigmoidBeforeBCE(_Once):
    """The step's loss is ``BCEWithLogitsLoss`` of scores made by a sigmoid (an ``nn.Sigmoid`` at the end of the model,
    ``torch.sigmoid``): the sigmoid applied twice. Every logit is squeezed into (0, 1), so every prediction is a
    probability in (0.5, 0.73): the model cannot predict a negative, and the loss cannot fall below ``log(1 + e^-1)``
    for a positive or ``log 2`` for a negative. ``BCELoss`` on those probabilities is right and not flagged. Critical
    (``unambiguous``, ``loss``)."""

    kind = "sigmoid_before_bce"
    hint = ("BCEWithLogitsLoss applies its own sigmoid: remove the final nn.Sigmoid / torch.sigmoid from the model (apply "
            "it only for predictions, probs = torch.sigmoid(logits)), or keep it and use nn.BCELoss (less stable in "
            "float16).")
    table, reference = BINARY, "with_logits"

    def found(self, table: dict[str, float]) -> bool:
        n, eps = table["targets"], table["eps"]
        return (table["min"] >= 0 and table["max"] <= 1 and matches(table["loss"], table["with_logits"], n, eps)
                and not matches(table["loss"], table["plain"], n, eps))

    def needs_twice(self, table: dict[str, float]) -> bool:
        return bool(table.get("raw"))  # raw scores taken through a sigmoid here: BCE of ~0.5 at initialisation

    def say(self, table: dict[str, float]) -> str:
        if table.get("raw"):
            return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is BCEWithLogitsLoss of the sigmoid of "
                    f"the outputs handed to step(): a sigmoid is applied between the model and BCEWithLogitsLoss, which "
                    f"applies its own, so every prediction is a probability between 0.5 and 0.73 and the model cannot "
                    f"predict a negative.")
        return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is BCEWithLogitsLoss of outputs that come "
                f"out of a sigmoid (between {table['min']:.3g} and {table['max']:.3g}): the sigmoid is applied twice, so "
                f"every prediction is a probability between 0.5 and 0.73 and the model cannot predict a negative.")


class PaddingInLoss(_Once):
    """The step's loss is the cross-entropy over every position of padded sequence targets, padding included: the
    targets' end value fills at least ``share`` (5 %) of the positions, runs to the end of at least 95 % of the rows,
    and sits where an integer input of the batch holds its own padding (at least 80 % of those positions, aligned or
    shifted by one); the loss equals the cross-entropy over all positions and differs from the one without the padding
    by over ``gap`` (1 %) of it. ``ignore_index`` was not set to the padding value (or a mask was not applied): the
    model learns to predict padding, which dilutes the gradient of the real tokens and makes the loss and the
    perplexity read better than the model is. ``persistent`` (a warning), once per run."""

    kind = "padding_in_loss"
    hint = ("Leave the padding out of the loss: nn.CrossEntropyLoss(ignore_index=PAD) (or F.cross_entropy(..., "
            "ignore_index=PAD)), or targets set to -100 at padded positions, or a mask: (loss * mask).sum() / mask.sum().")

    def __init__(self, *, share: float = 0.05, gap: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.share, self.gap = share, gap

    def found(self, table: dict[str, float]) -> bool:
        if "ce_unpadded" not in table:
            return False
        loss, ce, bare, eps = table["loss"], table["ce"], table["ce_unpadded"], table["eps"]
        padded = table["pad_share"] >= self.share and table["pad_suffix"] >= 0.95 and table["pad_inputs"] >= 0.8
        return padded and matches(loss, ce, table["targets"], eps) and abs(ce - bare) > self.gap * max(abs(bare), 1e-12)

    def say(self, table: dict[str, float]) -> str:
        return (f"the loss at step {int(table['step'])} ({table['loss']:.4g}) is the cross-entropy over every target "
                f"position, the padding included: the value {int(table['pad_value'])} ends the target rows, fills "
                f"{100 * table['pad_share']:.0f}% of the positions and sits where the inputs are padded; without those "
                f"positions the cross-entropy is {table['ce_unpadded']:.4g}. The model is trained to predict padding, "
                f"the real tokens' gradient is diluted, and the loss reads better than the model is.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        table = record.tables.get(self.table)
        if self._fired or not table or not self.found(table):
            return []
        self._fired = True
        return [self.make(int(table["step"]), self.say(table), table["loss"], table["ce_unpadded"], "loss",
                          ["persistent"])]

"""``loss_shape``: a regression loss taken between outputs and targets of shapes that broadcast to a larger one.

``F.mse_loss(model(x), y)`` with outputs ``(N, 1)`` and targets ``(N,)`` compares every output with every target:
both are broadcast to ``(N, N)``. Nothing crashes, torch warns once ("Using a target size ... that is different to
the input size"), and the model learns to predict the targets' mean. The probe looks for the pair on the batch and
outputs handed to ``step(loss, outputs=..., batch=...)``: float targets (``batch[1]``, ``batch['target']`` ...; option
``target``) and an output (option ``output`` for a structured one) whose shapes broadcast to more elements than either
holds. Only then, on that step, it takes MSE, L1 and smooth-L1 (Huber's ``delta=1``) both ways, broadcast and with
the output reshaped to the targets' shape, beside the loss the step was given; the rule compares them on the host. A
loop that squeezes the output inside its loss (the shapes it passes differ, its loss does not) is told apart by the
loss it hands over: it equals the aligned value, not the broadcast one.

Emits, at the logging step after a measured step, table ``diag/data/loss_shape``: ``step`` (the measured step),
``first`` (the first step the pair was handed over), ``loss`` (the step's), ``mse``, ``l1``, ``smooth_l1`` (the means
over the broadcast), ``mse_aligned``, ``l1_aligned``, ``smooth_l1_aligned`` (over the output reshaped to the targets';
NaN when the element counts differ), ``elements`` and ``aligned_elements`` (the counts the means are over, for a summed
loss), ``eps`` (the loss dtype's machine epsilon); tables ``diag/data/loss_shape_outputs`` / ``..._targets``
(dimension -> size). ``diag/data/loss_checks`` at every logging step: the steps measured so far (0: no broadcasting
pair seen). The ``loss_broadcast`` rule judges the table.

Cost: a host shape comparison per step for the first ``steps`` (200) steps and none after, unless a pair turned up;
~15 device ops on at most ``checks`` (5) steps with such a pair, one of them per logging window.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.tensors import TARGET_KEYS, logits_of, pick

MAX_ELEMENTS = 1 << 24  # the broadcast difference is materialised (float64) at most ``checks`` times: 128 MB


class LossShapeProbe(Probe):
    """See module docstring. Args: ``target`` index/key of the targets in the batch, ``output`` index/key of the
    prediction in a structured output, ``steps`` how many steps to look for a broadcasting pair, ``checks`` how
    many steps with one to measure."""

    name = "loss_shape"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, target: int | str | None = None,
                 output: int | str | None = None, steps: int = 200, checks: int = 5) -> None:
        super().__init__(enabled=enabled, every=every)
        self.target, self.output, self.steps, self.checks = target, output, steps, checks
        self._measured = 0
        self._first = -1  # the first step a broadcasting pair was handed over
        self._held: tuple[int, torch.Tensor, tuple[int, ...], tuple[int, ...], int, float] | None = None
        self._taken: tuple[int, tuple[int, ...], tuple[int, ...], int, float] | None = None

    def quiet(self, ctx: ProbeContext) -> bool:
        return self._measured >= self.checks or (ctx.step >= self.steps and not self._measured)

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._held is not None or self._measured >= self.checks \
                or (ctx.step >= self.steps and not self._measured) \
                or inputs.outputs is None or inputs.batch is None or len(inputs.losses) != 1:  # quiet(), inline
            return
        pair = self._pair(inputs)
        loss = next(iter(inputs.losses.values()))
        if pair is None or not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return
        out, y, elements = pair
        if self._first < 0:
            self._first = ctx.step
        with torch.no_grad():
            values = measure(out, y, loss)
        self._measured += 1
        eps = torch.finfo(loss.dtype).eps if loss.is_floating_point() else torch.finfo(torch.float32).eps
        self._held = (ctx.step, values, tuple(out.shape), tuple(y.shape), elements, eps)

    def _pair(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(output, targets, broadcast element count) when float targets and the output broadcast to more
        elements than either holds; else None. Host work only."""
        y = pick(inputs.batch, self.target, TARGET_KEYS, 1)
        if not isinstance(y, torch.Tensor) or not y.is_floating_point():
            return None
        out = logits_of(inputs.outputs, self.output)
        if out is None or out.shape == y.shape or out.device != y.device:
            return None
        try:
            full = torch.broadcast_shapes(out.shape, y.shape)
        except RuntimeError:
            return None
        elements = math.prod(full)
        if elements <= max(out.numel(), y.numel()) or elements > MAX_ELEMENTS:
            return None
        return out, y, elements

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        if self._held is None:
            self._taken = None
            return {"checks": float(self._measured)}
        step, values, out_shape, y_shape, elements, eps = self._held
        self._held = None
        self._taken = (step, out_shape, y_shape, elements, eps)
        return {"checks": float(self._measured), "values": values}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        record.scalars["diag/data/loss_checks"] = float(self._measured)
        got = values.get("values")
        if got is None or self._taken is None:
            return
        step, out_shape, y_shape, elements, eps = self._taken
        loss, *fns = (float(v) for v in got.reshape(-1))
        record.tables["diag/data/loss_shape"] = {
            "step": float(step), "first": float(self._first), "loss": loss,
            **dict(zip(("mse", "l1", "smooth_l1", "mse_aligned", "l1_aligned", "smooth_l1_aligned"), fns)),
            "elements": float(elements), "aligned_elements": float(math.prod(y_shape)), "eps": eps}
        record.tables["diag/data/loss_shape_outputs"] = {str(i): float(n) for i, n in enumerate(out_shape)}
        record.tables["diag/data/loss_shape_targets"] = {str(i): float(n) for i, n in enumerate(y_shape)}


def measure(out: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``[loss, MSE, L1, smooth-L1 broadcast, the same three aligned (NaN when the element counts differ)]`` as one
    device vector (means; the host scales them for ``reduction="sum"``), in float64 where the device has it: the
    recomputed values are exact beside the loss's own rounding, which is all the rule allows for."""
    wide = torch.float64 if out.device.type in ("cpu", "cuda") else torch.float32
    o, t = out.detach().to(wide), y.detach().to(wide)
    both = [_three(o - t)]
    if o.numel() == t.numel():
        both.append(_three(o.reshape(t.shape) - t))
    else:
        both.append([torch.full((), math.nan, dtype=wide, device=o.device)] * 3)
    return torch.stack([loss.detach().to(wide).reshape(()), *both[0], *both[1]])


def _three(diff: torch.Tensor) -> list[torch.Tensor]:
    a = diff.abs()
    return [diff.square().mean(), a.mean(), torch.where(a < 1, 0.5 * a * a, a - 0.5).mean()]

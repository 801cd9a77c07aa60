"""``eval_inputs`` (the probe): evaluation inputs not prepared as the training inputs were (``eval_input_shift``).

The training transform normalises (``Normalize(mean, std)``, a ``StandardScaler`` fitted on the training split,
``x / 255``) and the validation transform does not: the model sees inputs on another scale at evaluation, the
validation loss is high from the start and climbs as training sharpens the model, which reads as overfitting.
Nothing crashes.

From the first ``log_eval`` on, the probe watches each model's own calls (its call slot, as the ``eval_mode`` probe
does) and measures the first floating-point tensor argument, per feature (dim 1 of a ``(N, F)`` or ``(N, C, ...)``
input; one value for a 1-D input or one of over ``MAX_FEATURES`` features) as sums of the values and of their squares
on the device:

- training calls (autograd on, the model in training mode): the first call of each of the ``TRAIN_CALLS`` (8) steps
  after every ``log_eval``, pooled over the run (up to ``TRAIN_POOL`` calls);
- evaluation calls (autograd off, the model in eval mode) since the last ``step()``: the first ``EVAL_CALLS`` (8) of
  each evaluation (no-grad calls in training mode, an RL rollout or a GAN's fake batch at every step, cost nothing).

At each later ``log_eval``, with at least ``MIN_ROWS`` (32) rows of each and the same feature count, per component:
``diag/[<c>/]data/eval_input_scale`` (the median over features of the evaluation's standard deviation over the
training one; features constant in training left out) and ``diag/[<c>/]data/eval_input_offset`` (the median of
``|mean_eval - mean_train| / std_train``). One device-to-host copy per evaluation; per step, a dict look-up in the
model's call while the training samples are being taken, else an attribute read.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from trackdiag.capture.context import ProbeContext
from trackdiag.core.record import Record
from trackdiag.probes._eval_watch import EvalWatchProbe

TRAIN_CALLS = 8
TRAIN_POOL = 64
EVAL_CALLS = 8
MIN_ROWS = 32
MAX_FEATURES = 4096


def first_float(args: tuple[Any, ...]) -> torch.Tensor | None:
    """The first floating-point tensor among a call's positional arguments (one level into a tuple/list/dict)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point():
                return a
        elif isinstance(a, (tuple, list)):
            t = next((x for x in a if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
            if t is not None:
                return t
        elif isinstance(a, dict):
            t = next((x for x in a.values() if isinstance(x, torch.Tensor) and x.is_floating_point()), None)
            if t is not None:
                return t
    return None


def feature_moments(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """``(stack([sum, sum of squares]) per feature, rows)`` of ``x`` (features: dim 1), on its device: one ``var_mean``
    over the other dims (no copy of the input, no squared temporary; half-precision inputs are widened first)."""
    if x.dim() == 0 or x.numel() == 0 or x.is_complex():
        return None
    v = x.detach()
    if v.dim() == 1 or v.shape[1] > MAX_FEATURES:
        v = v.reshape(-1, 1)
    if v.dtype in (torch.float16, torch.bfloat16):
        v = v.float()
    rows = v.numel() // v.shape[1]
    var, mean = torch.var_mean(v, dim=[d for d in range(v.dim()) if d != 1], correction=0)
    return torch.stack([mean * rows, (var + mean * mean) * rows]).float(), rows


class _Moments:
    """Per-feature sums over the calls measured (device), and the rows they hold."""

    def __init__(self) -> None:
        self.sums: torch.Tensor | None = None
        self.rows, self.calls = 0, 0

    def add(self, x: torch.Tensor) -> None:
        got = feature_moments(x)
        if got is None:
            return
        sums, rows = got
        if self.sums is not None and self.sums.shape != sums.shape:
            return  # another feature count (another input): not pooled
        self.sums = sums if self.sums is None else self.sums + sums.to(self.sums.device)
        self.rows += rows
        self.calls += 1

    def moments(self) -> tuple[np.ndarray, np.ndarray]:
        s = self.sums.double().cpu().numpy() / self.rows  # type: ignore[union-attr]
        return s[0], np.sqrt(np.maximum(s[1] - s[0] ** 2, 0.0))


class EvalInputsProbe(EvalWatchProbe):
    """See module docstring."""

    name = "eval_inputs"

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._train: dict[str, _Moments] = {}
        self._eval: dict[str, tuple[int, _Moments]] = {}  # component -> (ctx.step of the calls, their moments)
        self._due: dict[str, int] = {}  # component -> training steps still to sample since the last log_eval
        self._sampled: dict[str, int] = {}  # component -> the ctx.step last sampled

    def _saw(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        ctx = self._ctx
        if ctx is None:
            return
        if torch.is_grad_enabled():
            if not module.training or self._due.get(name, 0) <= 0 or self._sampled.get(name) == ctx.step:
                return
            x = first_float(args)
            if x is not None:
                self._sampled[name] = ctx.step
                self._due[name] -= 1
                train = self._train.setdefault(name, _Moments())
                train.add(x)
            return
        if module.training:  # a rollout or a GAN's fake batch inside a training step: evaluations run in eval mode
            return
        step, moments = self._eval.get(name, (-1, None))
        if step != ctx.step or moments is None:  # the calls since the last step(); a no-grad call inside a step is dropped there
            moments = _Moments()
            self._eval[name] = (ctx.step, moments)
        if moments.calls < EVAL_CALLS:
            x = first_float(args)
            if x is not None:
                moments.add(x)

    def on_eval(self, ctx: ProbeContext, record: Record) -> None:
        if not self.watching:
            for comp in self.watch_models(ctx, lambda c: partial(self._saw, c.name)):
                self._due[comp.name] = TRAIN_CALLS
            return
        for comp in ctx.components:
            step, moments = self._eval.pop(comp.name, (-1, None))
            train = self._train.get(comp.name)
            if train is not None and train.calls < TRAIN_POOL:
                self._due[comp.name] = TRAIN_CALLS
            if moments is None or step != ctx.step or train is None or min(moments.rows, train.rows) < MIN_ROWS:
                continue
            if moments.sums is None or train.sums is None or moments.sums.shape != train.sums.shape:
                continue
            (mt, st), (me, se) = train.moments(), moments.moments()
            live = st > 1e-6 * max(float(st.max()), 1e-30)
            if not live.any():
                continue
            record.scalars[comp.key("data/eval_input_scale")] = float(np.median(se[live] / st[live]))
            record.scalars[comp.key("data/eval_input_offset")] = float(np.median(np.abs(me[live] - mt[live]) / st[live]))

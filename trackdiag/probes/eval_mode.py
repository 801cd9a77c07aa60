"""``eval_mode`` (the probe): an evaluation run with the model in training mode (``eval_train_mode``).

``model.eval()`` forgotten before a validation pass: dropout stays on (the evaluation is noisy and pessimistic) and
BatchNorm normalises with the evaluation batch's own statistics and folds them into its running ones (what the model
uses later includes the validation data). Nothing crashes.

From the first ``log_eval`` on, the probe watches each model's own calls (its call slot, as the NaN replay does: one
Python call per model call) and counts those made without autograd (``torch.no_grad()``, ``inference_mode``) while the
model is in training mode and holds modules whose behaviour depends on it (``Dropout`` with ``p > 0``, BatchNorm or
InstanceNorm with running statistics, in training mode), since the last ``step()``: an evaluation pass. Training
forwards run with autograd; a no-grad forward inside a training step (a GAN's fake batch, an RL rollout) comes before
that step's ``step()`` and is not counted. At each ``log_eval``: ``diag/[<c>/]model/eval_train_calls`` (such calls
since the last ``step()``) and, when there were any, the table ``[<c>/]model/eval_train_modules``
(``{module: 1.0 dropout | 2.0 normalisation}``). The first evaluation is not watched (the watch starts at it).
Compiled models are not watched (a recompile).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from trackdiag.capture.context import ProbeContext
from trackdiag.capture.forward_watch import FORWARD, may_watch
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.probes.modes import mode_dependent
from trackdiag.util.schedule import Never


class EvalModeProbe(Probe):
    """See module docstring."""

    name = "eval_mode"

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._stops: list[Any] = []
        self._ctx: ProbeContext | None = None
        self._calls: dict[str, tuple[int, int]] = {}  # component -> (ctx.step of the calls, no-grad train-mode calls)

    def bind(self, default_every: int) -> None:
        self.schedule = Never()  # never the reason for a logging step

    def quiet(self, ctx: ProbeContext) -> bool:
        return True

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    def _saw(self, name: str, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Pre-watcher of a model's call: count a no-grad call in training mode (an evaluation pass)."""
        if module.training and not torch.is_grad_enabled() and self._ctx is not None:
            step, n = self._calls.get(name, (-1, 0))
            self._calls[name] = (self._ctx.step, n + 1 if step == self._ctx.step else 1)

    def on_eval(self, ctx: ProbeContext, record: Record) -> None:
        """At ``log_eval``: what the models' calls since the last ``step()`` say; the watch starts at the first."""
        if not self._stops:
            if may_watch(ctx.compiled):
                for comp in ctx.components:
                    if comp.model is not None:
                        root = comp.outer if comp.outer is not None else comp.model
                        self._stops.append(FORWARD.watch(root, pre=partial(self._saw, comp.name), root=True))
            return
        for comp in ctx.components:
            step, n = self._calls.pop(comp.name, (-1, 0))
            if comp.model is None or step != ctx.step:
                continue
            modules = mode_dependent(comp.model, training=True)
            record.scalars[comp.key("model/eval_train_calls")] = float(n)
            if modules:
                record.tables[comp.key("model/eval_train_modules")] = modules

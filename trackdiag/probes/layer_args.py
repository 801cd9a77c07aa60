"""``layer_args``: layer arguments that do not mean what they were written for (``tf_convention``,
``linear_activation``). Nothing crashes and the model still learns, worse.

- ``nn.Dropout(p)``: ``p`` is the probability of *dropping* a unit. TF 1's ``keep_prob=0.9`` written as
  ``nn.Dropout(0.9)`` zeroes 90 % of the layer's inputs at every training step (and scales the rest x10).
- ``nn.BatchNorm*d(momentum=m)``: ``m`` is the weight of the *new* batch in the running statistics (default 0.1).
  Keras' ``momentum=0.99`` (TF's ``decay``: the weight of the old statistics) written as ``momentum=0.99`` makes the
  running statistics those of the last batch: every evaluation normalises with one batch's mean and variance.
- ``nn.LeakyReLU(True)``, written as ``nn.ReLU(True)`` is (``inplace``): LeakyReLU's first argument is
  ``negative_slope``, so the slope is 1 and the layer is the identity; the layers around it compose into one linear
  map.

At the first step the probe lists, per component, the model's dropout modules (the ``nn.Dropout`` family) with
``dropout_p <= p < 1`` (0.8; ``p = 1`` switches a layer off on purpose), its batch-norm modules that track running
statistics with ``momentum >= bn_momentum`` (0.5; ``None``, a cumulative average, is PyTorch's own choice) and its
``nn.LeakyReLU`` modules whose ``negative_slope`` is 1 (``True``). Emitted at the first logging step, only
when something is found: ``diag/[<c>/]model/dropout_p`` (``{module: p}``), ``diag/[<c>/]model/bn_momentum``
(``{module: momentum}``) and ``diag/[<c>/]model/leaky_slope`` (``{module: slope}``). Cost: one pass over the modules
at the first step.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.probes.modes import DROPOUT
from trackdiag.util.schedule import Never


def suspects(model: nn.Module, dropout_p: float, bn_momentum: float) -> dict[str, dict[str, float]]:
    """``{"dropout_p": {module: p}, "bn_momentum": {module: momentum}, "leaky_slope": {module: slope}}`` of
    ``model``'s layers whose argument reads as something else than it was likely written for."""
    out: dict[str, dict[str, float]] = {"dropout_p": {}, "bn_momentum": {}, "leaky_slope": {}}
    for name, m in model.named_modules():
        name = name or type(m).__name__
        if isinstance(m, DROPOUT) and dropout_p <= float(m.p) < 1.0:
            out["dropout_p"][name] = float(m.p)
        elif (isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats and m.momentum is not None
              and float(m.momentum) >= bn_momentum):
            out["bn_momentum"][name] = float(m.momentum)
        elif isinstance(m, nn.LeakyReLU) and float(m.negative_slope) == 1.0:  # True, as nn.LeakyReLU(True) sets it
            out["leaky_slope"][name] = float(m.negative_slope)
    return out


class LayerArgsProbe(Probe):
    """See module docstring. Args: ``dropout_p`` and ``bn_momentum``, the values from which a layer is listed."""

    name = "layer_args"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, dropout_p: float = 0.8,
                 bn_momentum: float = 0.5) -> None:
        super().__init__(enabled=enabled, every=every)
        problems = [f"diag.probes.layer_args.{key}: must be in (0, 1], got {value!r}"
                    for key, value in (("dropout_p", dropout_p), ("bn_momentum", bn_momentum)) if not 0 < value <= 1]
        if problems:
            raise ConfigError(problems)
        self.dropout_p, self.bn_momentum = float(dropout_p), float(bn_momentum)
        self._found: list[tuple[Any, dict[str, dict[str, float]]]] = []  # (component, suspects), until published
        self._done = False

    def bind(self, default_every: int) -> None:
        self.schedule = Never()

    def quiet(self, ctx: ProbeContext) -> bool:
        return self._done and not self._found

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._done:
            return
        self._done = True
        for comp in ctx.components:
            if isinstance(comp.model, nn.Module):
                found = suspects(comp.model, self.dropout_p, self.bn_momentum)
                if any(found.values()):
                    self._found.append((comp, found))

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        return {"layers": float(len(self._found))} if self._found else {}  # publish() is called for what was collected

    def publish(self, ctx: ProbeContext, values: dict[str, Any], record: Record) -> None:
        found, self._found = self._found, []
        for comp, tables in found:
            for what, table in tables.items():
                if table:
                    record.tables.setdefault(comp.key(f"model/{what}"), {}).update(table)

"""Dead / saturated unit probe, from forward hooks attached only for the steps that are due.

Watched modules: the ReLU family (ReLU, ReLU6, LeakyReLU, PReLU, RReLU, ELU, CELU, SELU, GELU, SiLU,
Mish, Hardswish): a unit is *active* on a sample when its output is > 0 (ReLU6: strictly inside
(0, 6)); the saturating family (Sigmoid, Hardsigmoid, Tanh, Softsign, Hardtanh): a unit is active
when its output is off the flat tails (``|2y-1| < saturation`` for sigmoids, ``|y| < saturation``
for tanh-likes, strictly inside the clip range for the hard variants). A functional ``F.relu`` after
an ``nn.Linear`` is not a module and is not seen. The unit axis is dim 1 for 4-D/5-D outputs
(N, C, ...) and the last dim otherwise ((N, F) and (N, T, D)).

Emits per component and module (train-mode forwards only), once the module has been seen:
  ``diag/[<c>/]act/dead_fraction/<module>`` (ReLU family): the fraction of units never active on any
      sample of the last ``window`` (3) sampled steps (micro-batches included);
  ``diag/[<c>/]act/saturated_fraction/<module>`` (saturating family): the fraction of units on the
      flat tails for at least ``saturated_share`` (95%) of those samples;
  ``diag/[<c>/]act/dead_fraction_max`` / ``saturated_fraction_max``: the worst module.
Beyond the session's key budget, modules are grouped by name prefix (unit-weighted) and the full
per-module table goes to ``record.tables``.

How it sees the outputs: through trackdiag's global forward watcher (:mod:`trackdiag.capture.forward_watch`),
armed in ``on_step`` of the step *before* a due step and disarmed in ``on_step`` of the due step;
nothing is registered on the modules (``torch.save(model)`` stays clean). When some part of the
model is compiled, the training forward is not watched (that would break or recompile its graph):
instead, on a due step, the step's batch (``step(batch=...)``) is run once more through the model
eagerly (no grad, train mode, buffers/RNG/attributes restored) and that forward is watched.

Cost: per watched module and watched forward, one comparison and one ``sum`` reduction into a
per-unit count on device; under compile, one extra no-grad forward per due step. Nothing at all on
other steps.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.layers import group_names
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.tensors import inputs_of

log = logging.getLogger("trackdiag")

RELU_FAMILY: tuple[type[nn.Module], ...] = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.CELU,
                                            nn.SELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish)
SATURATING: tuple[type[nn.Module], ...] = (nn.Sigmoid, nn.Hardsigmoid, nn.Tanh, nn.Softsign, nn.Hardtanh)


def family_of(module: nn.Module) -> str | None:
    """``"dead"`` for the ReLU family, ``"saturated"`` for the saturating one, else None."""
    if isinstance(module, RELU_FAMILY):
        return "dead"
    if isinstance(module, SATURATING):  # ReLU6 subclasses Hardtanh: matched above
        return "saturated"
    return None


def active(module: nn.Module, y: torch.Tensor, saturation: float) -> torch.Tensor:
    """Element-wise bool: the unit is active (not dead, not saturated) on this element."""
    if isinstance(module, nn.ReLU6):
        return (y > 0) & (y < 6)
    if isinstance(module, RELU_FAMILY):
        return y > 0
    if isinstance(module, nn.Hardtanh):
        return (y > module.min_val) & (y < module.max_val)
    if isinstance(module, nn.Hardsigmoid):
        return (y > 0) & (y < 1)
    if isinstance(module, nn.Sigmoid):
        return (2 * y - 1).abs() < saturation
    return y.abs() < saturation  # Tanh, Softsign


def unit_counts(act: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Per-unit count of active elements over every other axis (units: dim 1 of 4-D/5-D, else the
    last dim), and the number of elements per unit."""
    dim = 1 if act.ndim in (4, 5) else act.ndim - 1
    flat = act.movedim(dim, -1).reshape(-1, act.shape[dim])
    return flat.sum(dim=0, dtype=torch.float32), flat.shape[0]


class ActivationProbe(Probe):
    """See module docstring. Args: ``window`` sampled steps the statistics cover; ``saturation`` the
    sigmoid/tanh saturation level (0.99: derivative below ~2% of its peak); ``saturated_share`` the
    share of samples (0.95) a saturating unit must sit on the tails to count as saturated."""

    name = "activations"
    follows_anomaly = False  # too costly to run on every step of an anomaly window

    def __init__(self, *, enabled: bool = True, every: int | None = None, window: int = 3, saturation: float = 0.99,
                 saturated_share: float = 0.95) -> None:
        super().__init__(enabled=enabled, every=every)
        self.window, self.saturation, self.saturated_share = max(1, window), saturation, saturated_share
        self._modules: list[tuple[str, str, nn.Module, str]] = []  # (component, name, module, family)
        self._stops: list[Any] = []
        self._keys: list[tuple[str, str, str]] = []  # collect's order: (component, name, family)
        self._cur: dict[tuple[str, str, str], tuple[torch.Tensor, int]] = {}
        self._hist: dict[tuple[str, str, str], deque[tuple[torch.Tensor, int]]] = {}
        self._units: dict[tuple[str, str], int] = {}
        self._ctx: ProbeContext | None = None

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx
        for comp in ctx.components:
            if comp.model is None:
                continue
            for name, mod in comp.model.named_modules():
                fam = family_of(mod)
                if fam is not None:
                    self._modules.append((comp.name, name or type(mod).__name__, mod, fam))
        if ctx.is_due(self.schedule) and not ctx.compiled:
            self._hook()

    def _hook(self) -> None:
        for comp, name, mod, fam in self._modules:
            self._stops.append(FORWARD.watch(mod, post=partial(self._observe, comp, name, fam)))

    def _unhook(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    @torch.no_grad()
    def _observe(self, comp: str, name: str, fam: str, module: nn.Module, inputs: Any, kwargs: Any, output: Any) -> None:
        if not self.enabled or not module.training or not isinstance(output, torch.Tensor) \
                or not output.is_floating_point() or output.ndim < 2:
            return
        t0 = time.perf_counter()
        counts, n = unit_counts(active(module, output.detach(), self.saturation))
        units = self._units.setdefault((comp, name), counts.numel())
        key = (comp, name if units == counts.numel() else f"{name} ({counts.numel()} units)", fam)
        self._units.setdefault((comp, key[1]), counts.numel())
        prev = self._cur.get(key)
        self._cur[key] = (counts, n) if prev is None else (prev[0] + counts, prev[1] + n)
        if self._ctx is not None:
            self._ctx.hook_seconds += time.perf_counter() - t0

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if ctx.compiled:
            if ctx.is_due(self.schedule):
                self._replay(ctx, inputs)
            return
        nxt = ctx.step + 1
        want = self.schedule(nxt) or (nxt <= ctx.anomaly_until and self.follows_anomaly)
        if want and not self._stops:
            self._hook()
        elif not want and self._stops:
            self._unhook()

    def _replay(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        """Compiled model: watch one eager, no-grad forward of the step's batch (state restored)."""
        from trackdiag.capture.isolation import isolated

        if inputs.batch is None:
            if "activations" not in ctx.notes:
                ctx.notes["activations"] = ("activations of a compiled model are measured by an eager forward of "
                                            "step(batch=...): none was given, so diag/act/* is not recorded")
                log.warning("trackdiag: %s", ctx.notes["activations"])
            return
        model_input = inputs_of(inputs.batch)
        for comp in ctx.components:
            model = comp.model
            if model is None or not any(c == comp.name for c, *_ in self._modules):
                continue
            self._hook()
            try:
                with isolated(model), torch.no_grad():
                    model.train()
                    model(model_input)
            finally:
                self._unhook()

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._keys = []
        for key, counts in self._cur.items():
            hist = self._hist.setdefault(key, deque(maxlen=self.window))
            hist.append(counts)
            total = torch.stack([c for c, _ in hist]).sum(dim=0)
            if key[2] == "dead":
                inactive = total == 0
            else:
                inactive = total < (1.0 - self.saturated_share) * sum(n for _, n in hist)
            out[str(len(self._keys))] = inactive.float().mean()
            self._keys.append(key)
        self._cur = {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        by_prefix: dict[str, dict[str, tuple[float, int]]] = {}
        for pos, v in values.items():
            comp, name, fam = self._keys[int(pos)]
            prefix = f"diag/{comp}/act/{fam}_fraction" if comp else f"diag/act/{fam}_fraction"
            units = self._units.get((comp, name), 1)
            by_prefix.setdefault(prefix, {})[name] = (float(v[0]), units)
        for prefix, mods in by_prefix.items():
            record.scalars[f"{prefix}_max"] = max(f for f, _ in mods.values())
            names = list(mods)
            if len(names) <= ctx.layer_budget:
                for n, (f, _) in mods.items():
                    record.scalars[f"{prefix}/{n}"] = f
                continue
            record.tables[prefix] = {n: f for n, (f, _) in mods.items()}
            dead: dict[str, list[float]] = {}
            for n, g in zip(names, group_names(names, ctx.layer_budget), strict=True):
                f, units = mods[n]
                acc = dead.setdefault(g, [0.0, 0.0])
                acc[0] += f * units
                acc[1] += units
            for g, (d, u) in dead.items():
                record.scalars[f"{prefix}/{g}"] = d / max(u, 1.0)

    def detach(self) -> None:
        self._unhook()

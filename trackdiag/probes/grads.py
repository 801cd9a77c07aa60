"""Gradient probe: the gradients as the backward pass left them (before clipping), every step.

Emits per component (``diag/`` or ``diag/<component>/``):
  series ``grad/global_norm``: the pre-clip global L2 norm at **every** step (kept on the device
      between logging steps, like the loss): equal to what ``clip_grad_norm_`` returns when the
      loop clips, and to the norm the optimizer sees when it does not. Steps a ``GradScaler``
      skipped (overflow) are left out;
  on due steps: ``grad/max_abs`` (pre-clip), ``grad/nonfinite_tensors`` (parameter tensors whose
      gradient holds a NaN/Inf), ``grad/clipped_norm`` and ``grad/clip_coef`` (= clipped / pre-clip)
      when something changed the gradients between the backward pass and the optimizer step
      (``clip_grad_norm_``; under AMP also ``unscale_``, coef 1), and, with ``per_layer``,
      ``grad/norm/<layer>`` (pre-clip; layers coarsened to the session's ``max_layer_metrics``
      budget, the full table in ``record.tables`` when coarsened).
  ``grad/wiped_steps`` (every logging step, when some step of the window had them): optimizer steps
      that found the gradients wiped after the backward pass (the sentinel parameter's gradient,
      non-zero when the pass ended, zero or ``None`` when the optimizer ran: ``clip_grad_norm_`` with
      ``max_norm=0``, a ``zero_grad`` between ``backward`` and ``step``), with the table
      ``grad/wiped`` = ``{"first": step, "run": n, "of": steps}``: the run of consecutive wiped steps
      going on at the window's end (carried across windows) and where it began.
  ``opt/unstepped`` (a table, while a run of such steps goes on): steps in a row in which a backward pass reached the
      component and none of its optimizers stepped (a GradScaler's skipped steps not counted): ``{"first": step, "run":
      n, "gap": the longest such run that ended in an optimizer step (accumulation over micro-batches each given to
      step()), "from_start": 1.0 when it began at the component's first step, "others_step": 1.0 when some component's
      optimizer has stepped}``, read by ``optimizer_idle``.
  ``grad/reach`` (a table, only when the window's last pre-clip norm is exactly 0: no gradient reached any parameter
      the optimizer holds): ``{"backward": 1.0 if a backward pass reached them in that step (and left exactly 0),
      "graph": 1.0 if the step's loss has an autograd graph, "reaches": 1.0 if that graph reaches those parameters
      (0.0: it does not, -1.0: too large to tell), "replaced": 1.0 if none of the model's own parameters is a tensor
      the optimizer holds (each replaced after it was built)}``, read by ``grads_missing``.
Cost: per step, the global norm the tap took (see :mod:`trackdiag.capture.gradtap`: one pass over the
gradients, the sentinel's norm among its per-tensor norms) and, when the optimizer steps, a look at the
sentinel's gradient: none when it is the tensor the backward pass left at the same version (two attribute
reads), else one norm of that small tensor ("wiped" is decided for the whole window at the logging
step); on due steps the per-tensor norms, a few reductions, and one more
``_foreach_norm`` only when the gradients were clipped. Host reads: none off logging steps.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.grad_records import GradView, sentinel_norm, totals
from trackdiag.capture.graph_reach import graph_reach
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe, take_pending
from trackdiag.util.norms import cat_chunks, max_abs, plain, stack_scalars, tensor_norms  # noqa: F401  (re-exported for user probes)


def publish_layers(prefix: str, comp: Component, per_layer: np.ndarray, record: Record, per_group: np.ndarray | None) -> None:
    """Per-layer values as metric keys ``<prefix>/<layer or group>``, plus the full table when
    the layers had to be coarsened to fit the key budget."""
    idx = comp.index
    if len(per_layer) != len(idx.layers):  # measured before the component was re-indexed
        return
    if idx.grouped and per_group is not None:
        for g, v in zip(idx.groups, per_group.tolist()):
            record.scalars[f"{prefix}/{g}"] = v
        record.tables[prefix] = dict(zip(idx.layers, per_layer.tolist()))
    else:
        for layer, v in zip(idx.layers, per_layer.tolist()):
            record.scalars[f"{prefix}/{layer}"] = v


def first_bad_layer(comp: Component, per_layer: np.ndarray) -> str:
    """Name of the first layer (forward order) whose value is not finite, or ``""``."""
    for layer, v in zip(comp.index.layers, per_layer.tolist()):
        if not math.isfinite(v):
            return layer
    return ""


def scaler_skipped(ctx: ProbeContext, comp: Component, view: GradView) -> bool:
    """A ``GradScaler`` step that did not run the optimizer (overflow): its gradients are not the run's."""
    scaler = ctx.scaler
    return not view.stepped and bool(comp.optimizers) and scaler is not None and bool(getattr(scaler, "_enabled", False))


class GradProbe(Probe):
    """See module docstring. Args: ``per_layer`` also emit per-layer norms."""

    name = "grads"
    wants_detail = True
    always_collect = True  # the every-step norm series

    def __init__(self, *, enabled: bool = True, every: int | None = None, per_layer: bool = True) -> None:
        super().__init__(enabled=enabled, every=every)
        self.per_layer = per_layer
        self._pending: dict[str, dict[str, torch.Tensor]] = {}
        self._ring: dict[str, list[tuple[int, Any]]] = {}  # per step: Tap.lazy()
        #: per component: the window's earlier steps and their norms, worked out by the cost budget's window checks
        self._folded: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        self._steps: dict[str, list[int]] = {}
        self._kept: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}  # per step: sentinel norm at backward, at the step
        self._kept_steps: dict[str, list[int]] = {}
        self._looked: dict[str, list[bool]] = {}  # per kept step: was the gradient touched (a wiped flag computed)
        self._run: dict[str, tuple[int, int]] = {}  # component -> (first step, length) of the current wiped run
        #: component -> (first step, length) of the run of steps going on in which a backward pass reached it and its
        #: optimizer did not step
        self._idle: dict[str, tuple[int, int]] = {}
        self._gap: dict[str, int] = {}  # component -> the longest run of steps without an optimizer step, once ended
        self._first: dict[str, int] = {}  # component -> the first step it was measured at
        self._stepped = False  # some component's optimizer has stepped

    def on_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        if not comp.index.params:
            return
        if view.stepped or not comp.optimizers or not scaler_skipped(ctx, comp, view):
            ring = self._ring.get(comp.name)
            if ring is None:
                ring = self._ring[comp.name] = []
                self._first.setdefault(comp.name, ctx.step)
            if view.stepped:
                self._stepped = True
                if self._idle:  # an optimizer stepping again after steps without: the loop's rhythm (accumulation)
                    self._end_idle(comp.name)
            elif comp.optimizers and view.source == "backward":  # a backward pass reached it, its optimizer did not step
                first, run = self._idle.get(comp.name, (ctx.step, 0))
                self._idle[comp.name] = (first, run + 1)
            tap = view.tap  # Tap.lazy() inline: a frame less on every step
            ring.append((ctx.step, tap.total_ if tap.total_ is not None else (tap.parts, tap.scale)))
            pre = tap.sentinel
            if view.stepped and view.source == "backward" and pre is not None and view.sentinel is not None:
                # what the optimizer finds of the sentinel's gradient, as a share of what the backward left
                g = view.sentinel.grad
                if g is tap.sentinel_grad and g is not None and g._version == tap.sentinel_version:
                    now = None  # the tensor the backward left, untouched since: not wiped (no kernel, nothing to compare)
                else:  # gone (None), replaced, or changed in place (clipped, unscaled, zeroed): look at it, one kernel
                    now = pre.new_zeros(()) if g is None else sentinel_norm(g)
                kept = self._kept.get(comp.name)
                if kept is None:
                    kept = self._kept[comp.name] = []
                kept.append((ctx.step, pre, now))
        if ctx.is_due(self.schedule):
            with torch.no_grad():  # a create_graph backward leaves gradients in a graph: not these norms
                self._measure(comp, view)

    def on_more_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        """The step's gradients with a later optimizer's own pass merged in: they replace what was kept."""
        ring = self._ring.get(comp.name)
        if ring and ring[-1][0] == ctx.step:
            ring[-1] = (ctx.step, view.tap.lazy())
        if comp.name in self._pending and ctx.is_due(self.schedule):
            with torch.no_grad():
                self._measure(comp, view)

    def _measure(self, comp: Component, view: GradView) -> None:
        total = view.total
        norms = view.norms
        bad = ~torch.isfinite(norms)
        out = {"pre_norm": total, "max_abs": view.tap.max_abs if view.tap.max_abs is not None else max_abs(comp.index.grads())}
        if view.modified():  # clipped, unscaled, or edited by hand after the backward pass
            now = view.now_norms()
            out["clipped_norm"] = torch.linalg.vector_norm(now)
            bad = bad | ~torch.isfinite(now)  # a NaN written after the backward pass counts too
        out["nonfinite_tensors"] = bad.sum()
        if self.per_layer:
            layer = comp.index.per_layer_norm(norms)
            out["layer_norm"] = layer
            if comp.index.grouped:
                out["group_norm"] = comp.index.per_group_norm(layer)
        self._pending[comp.name] = out

    def window_values(self) -> dict[str, list[Any]]:
        """Each model's pre-clip gradient norms since the last call or logging step (see
        ``LossProbe.window_values``), kept for the logging step's series: each step's norm is worked out once."""
        out = {}
        for name, ring in self._ring.items():
            if ring:
                chunk = totals([v for _, v in ring])
                steps, chunks = self._folded.setdefault(name, ([], []))
                steps += [s for s, _ in ring]
                chunks.append(chunk)
                ring.clear()
                out[f"grad:{name}"] = [chunk]
        return out

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out = take_pending(self._pending)
        self._kept_steps = {}
        for name, kept in self._kept.items():
            if kept:
                self._kept_steps[name] = [s for s, _, _ in kept]
                looked = [(p, n) for _, p, n in kept if n is not None]  # the steps whose gradient was touched
                self._looked[name] = [n is not None for _, _, n in kept]
                if looked:
                    pre, now = stack_scalars([p for p, _ in looked]), stack_scalars([n for _, n in looked])
                    out[f"{name}|wiped"] = ((now <= 1e-6 * pre) & (pre > 0)).float()  # the window at once
                else:
                    out[f"{name}|wiped"] = 0.0  # host: nothing touched, nothing wiped
                kept.clear()
        self._steps = {}
        for name, ring in self._ring.items():
            steps, chunks = self._folded.get(name, ([], []))
            if ring:  # 2-3 kernels for the window (or its part since the cost budget's last window check)
                steps, chunks = [*steps, *(s for s, _ in ring)], [*chunks, totals([v for _, v in ring])]
            if steps:
                self._steps[name] = steps
                out[f"{name}|global_norm_series"] = cat_chunks(chunks)
            ring.clear()
        self._folded = {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            get = lambda k: values.get(f"{comp.name}|{k}")  # noqa: E731
            wiped = get("wiped")
            if wiped is not None:
                flags = iter(wiped.reshape(-1).tolist())
                looked = self._looked.get(comp.name, [])
                self._publish_wiped(comp, [next(flags) if touched else 0.0 for touched in looked], record)
            if self._idle:
                self._publish_idle(comp, record)
            series = get("global_norm_series")
            if series is not None:
                points = list(zip(self._steps.get(comp.name, []), map(float, series.tolist())))
                record.series[comp.key("grad/global_norm")] = points
                if points and points[-1][1] == 0.0 and ctx.losses:  # no gradient reached it: why (grads_missing)
                    self._publish_reach(ctx, comp, record)
            if get("pre_norm") is None:
                continue
            for k in ("max_abs", "nonfinite_tensors"):
                record.scalars[comp.key(f"grad/{k}")] = float(get(k)[0])
            clipped = get("clipped_norm")
            if clipped is not None:
                pre, post = float(get("pre_norm")[0]), float(clipped[0])
                record.scalars[comp.key("grad/clipped_norm")] = post
                record.scalars[comp.key("grad/clip_coef")] = post / pre if pre > 0 and math.isfinite(pre) else math.nan
            layer = get("layer_norm")
            if layer is not None:
                publish_layers(comp.key("grad/norm"), comp, layer, record, get("group_norm"))
                bad = first_bad_layer(comp, layer)
                if bad:
                    record.tables.setdefault(comp.key("grad/nonfinite_layers"), {})[bad] = 1.0

    @staticmethod
    def _publish_reach(ctx: ProbeContext, comp: Component, record: Record) -> None:
        """``grad/reach``: whether the loss given to this step has a graph and whether it reaches the parameters the
        component's optimizers hold (:func:`~trackdiag.capture.graph_reach.graph_reach`), when none got a gradient."""
        losses = ctx.losses or {}
        loss = losses.get(comp.name, losses.get(""))
        if loss is None and len(losses) == 1:
            loss = next(iter(losses.values()))
        reach = {"backward": float(comp.name in ctx.backward_seen), **graph_reach(loss, comp.index.params)}
        if comp.model is not None:  # the model's own parameters, none of them a tensor the optimizer holds
            held = {id(p) for p in comp.index.params}
            own = [p for p in comp.model.parameters() if p.requires_grad]
            reach["replaced"] = float(bool(own) and not any(id(p) in held for p in own))
        record.tables[comp.key("grad/reach")] = reach

    def _end_idle(self, name: str) -> None:
        """The component's optimizer stepped: a run of steps without it, if one was going on, is the loop's rhythm."""
        idle = self._idle.pop(name, None)
        if idle is not None:
            self._gap[name] = max(self._gap.get(name, 0), idle[1])

    def _publish_idle(self, comp: Component, record: Record) -> None:
        """``opt/unstepped``: the run going on of steps whose backward pass reached the component while its optimizer
        did not step (``optimizer_idle``)."""
        idle = self._idle.get(comp.name)
        if idle is None:
            return
        first, run = idle
        record.tables[comp.key("opt/unstepped")] = {
            "first": float(first), "run": float(run), "gap": float(self._gap.get(comp.name, 0)),
            "from_start": float(first == self._first.get(comp.name)), "others_step": float(self._stepped)}

    def _publish_wiped(self, comp: Component, flags: list[float], record: Record) -> None:
        """The run of consecutive wiped steps (carried across windows): its first step and length."""
        start, run = self._run.get(comp.name, (-1, 0))
        steps = self._kept_steps.get(comp.name, [])
        for s, w in zip(steps, flags):
            start, run = (start if run else s, run + 1) if w else (-1, 0)
        self._run[comp.name] = (start, run)
        n = sum(1 for w in flags if w)
        if n:
            record.scalars[comp.key("grad/wiped_steps")] = float(n)
            record.tables[comp.key("grad/wiped")] = {"first": float(start if run else steps[flags.index(1.0)]),
                                                     "run": float(run), "of": float(len(flags))}

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        self._pending.pop(comp.name, None)

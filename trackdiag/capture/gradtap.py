"""The gradient tap: gradients measured as the backward pass left them, before anyone changes them.

Why: the optimizer's step hooks run after the user's ``clip_grad_norm_`` and ``scaler.unscale_``,
so a norm read there is the post-clip norm (pinned at the clip value), and a loop without an
optimizer, or one that passes a closure to ``step``, never shows its gradients there at all.

How: a tensor hook on the trainable parameters of every component (:mod:`trackdiag.capture.tap_hooks`; one per built-in
layer: a Linear's weight stands for its bias, see :func:`firing`; parameter hooks are not saved by ``torch.save``, are
not deep-copied, and run in the autograd engine, outside any compiled graph). The first hook to fire in a backward pass queues one end-of-backward callback (under
``torch.distributed`` twice removed, so it runs after DDP's and FSDP's own end-of-backward work); that
callback measures, for each component the pass reached, the global L2 norm of the accumulated gradients
(fp32, divided by the ``GradScaler``'s scale when there is one). A model of at most ``LAZY_TENSORS`` tensors (any
size) is kept as its per-tensor norms, one ``_foreach_norm``, and their norm is worked out when first asked for: the
every-step series asks for a whole window at the logging step (:func:`totals`: one ``stack`` and one norm for the
window), so a plain step pays one kernel; ``clip_grad_norm_``'s arithmetic. A model of more tensors is taken at once
(off the CPU: the foreach norms' norm, 3 kernels; on the CPU: small tensors in chunks, a dot per large one,
:func:`~trackdiag.util.norms.global_norm`). On steps that need detail also the per-tensor norms, the largest
magnitude and the gradients' version counters (to tell later whether something clipped or unscaled
them). One parameter per component, the *sentinel*, also records per backward whether its gradient was
reset (``None`` or all zero) before the pass accumulated into it, the parameter's version counter, and
(from its L2 norm at the end of the pass, one of the per-tensor norms above) whether the pass left it
non-zero: that is what the zero-grad verdicts are made of (:mod:`trackdiag.probes.zerograd`).

Cost per backward pass: one Python call per hooked parameter that receives a gradient (~0.3-1 us), one
``_foreach_norm`` (a small model; under a scaler its norm and a tiny division too); on the sentinel, one
all-zero test (2 small ops) when its gradient was not ``None``. No host read. Detail steps add a
``stack``, a norm, a ``max_abs`` reduction and a host pass over the version counters.
"""
from __future__ import annotations

import functools
import logging
import operator
import time
from typing import Callable

import torch

from trackdiag.capture import clip_serve
from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.grad_records import (VERSION, GradView, Pass, Tap, foreach_norms, plain_tap, sentinel_norm,
                                            sentinel_raw, totals)
from trackdiag.capture.tap_hooks import TAP_QUEUE, CompTap, firing, hookable, pick_sentinel, watched
from trackdiag.util.norms import global_norm, grad_norms, max_abs

GRAD = operator.attrgetter("grad")
_is_none = functools.partial(operator.is_, None)

__all__ = ["TAP_QUEUE", "GradTap", "GradView", "Pass", "Tap", "firing", "pick_sentinel", "sentinel_norm", "totals"]

log = logging.getLogger("trackdiag")


#: a pass of at most this many gradient tensors keeps its per-tensor norms until its total is asked for
LAZY_TENSORS = 64


class GradTap:
    """The session's tap over its components (see module docstring).

    Args:
        ctx: the session's probe context (step, scaler, hook-time accounting).
        detail: ``() -> bool``: does the step in progress need max-abs and version counters?
    """

    def __init__(self, ctx: ProbeContext, detail: Callable[[], bool],
                 refresh: Callable[[Component], None] | None = None,
                 closure_began: Callable[[Component], None] | None = None) -> None:
        self.ctx = ctx
        self.detail = detail
        self.refresh = refresh  # called before measuring: follows param groups added since the last step
        #: called at the first backward pass inside ``optimizer.step(closure)``: the weights the closure evaluated
        #: (after what it did to them first: LBFGS style transfer clamps the image there) are the step's start
        self.closure_began = closure_began
        self.states: dict[str, CompTap] = {}
        self.failed: str | None = None
        TAP_QUEUE.taps.append(self)
        clip_serve.install()

    # ------------------------------------------------------------------ hooks
    def attach(self, comp: Component, sentinel: torch.Tensor | None = None) -> None:
        """(Re-)hook ``comp``'s trainable parameters; called again when its parameters change, or with
        another ``sentinel`` when the first one stopped receiving gradients."""
        st = self.states.get(comp.name)
        if st is None:
            st = self.states[comp.name] = CompTap(comp)
        st.comp = comp
        if st.generation == comp.generation and sentinel is None:
            return
        self._unhook(st)
        st.generation = comp.generation
        st.params_of = {g: ids for g, ids in st.params_of.items() if g >= comp.generation - 1}
        st.params_of[comp.generation] = tuple(id(p) for p in comp.index.params)
        params = watched(comp)
        st.sentinel = sentinel if sentinel is not None else pick_sentinel(comp)
        st.misses, st.last_nonzero, st.switched = 0, True, sentinel is not None
        try:
            with hookable(params):
                self._hook_layers(st, params)
                if st.sentinel is not None:
                    st.handles.append(st.sentinel.register_hook(st.watch))
                    st.handles.append(st.sentinel.register_post_accumulate_grad_hook(st.accumulated))
        except RuntimeError as exc:  # e.g. a parameter that cannot take hooks
            self._unhook(st)
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("trackdiag: gradient tap off for %r (%s): gradients are read at the optimizer step "
                        "(after any clipping)", comp.name or "model", self.failed)

    def _hook_layers(self, st: CompTap, params: list[torch.Tensor]) -> None:
        """The per-layer hooks of ``st``'s component (every trainable parameter but the sentinel, one per built-in
        layer: :func:`firing`)."""
        st.thin, st.whole, st.fires = False, 0, 0
        fire = firing(st.comp.model, params, st.sentinel)
        st.layer_handles.extend(p.register_hook(st.fire) for p in params if p is not st.sentinel and id(p) in fire)

    def _unhook(self, st: CompTap) -> None:
        for h in (*st.handles, *st.layer_handles):
            h.remove()
        st.handles.clear()
        st.layer_handles.clear()

    def detach(self) -> None:
        for st in self.states.values():
            self._unhook(st)
        if self in TAP_QUEUE.taps:
            TAP_QUEUE.taps.remove(self)
        clip_serve.forget(self.states.values())
        if not TAP_QUEUE.taps:
            clip_serve.uninstall()

    # ------------------------------------------------------------------ measuring
    def end_of_backward(self) -> None:
        """For each component this backward reached: measure its accumulated gradients."""
        t0 = time.perf_counter()
        scale: torch.Tensor | None | bool = False  # read once per pass, when a component needs it
        for st in self.states.values():
            if not st.fired:
                continue
            st.fired = False
            st.count += 1
            try:
                if self.refresh is not None and st.comp.refreshed != self.ctx.step:  # once per step
                    self.refresh(st.comp)
                if scale is False:
                    scale = self.scale() if self.ctx.scaler is not None else None
                tap = self.measure(st.comp, st.count, scale=scale, sentinel=st.sentinel, keep=st.clip_armed)
                raw = tap.sentinel
                if raw is not None:
                    tap.sentinel = raw / scale if scale is not None else raw
                    if st.saw:  # what this pass left: its norm is 0 exactly when every value is
                        st.last_nonzero = raw
            except Exception as exc:  # noqa: BLE001 - never raise into the user's backward
                log.warning("trackdiag: gradient tap failed (%s: %s): reading at the optimizer step instead",
                            type(exc).__name__, exc)
                self.detach()
                self.failed = f"{type(exc).__name__}: {exc}"
                return
            st.latest = tap
            if st.in_closure and st.first_in_step is None:
                st.first_in_step = tap
                if self.closure_began is not None:
                    self.closure_began(st.comp)
            if not st.saw or st.misses:
                self._follow_sentinel(st)
            if st.thin:  # what passed() does once the sentinel stands alone, inline (a frame a pass)
                st.fires = st.whole = 0
            elif st.passed():
                st.thin_out()
            st.saw = False
        self.ctx.hook_seconds += time.perf_counter() - t0

    def _follow_sentinel(self, st: CompTap) -> None:
        """A sentinel that 3 backward passes in a row did not reach (a layer of a later phase, a head unused
        until fine-tuning) is replaced by the smallest parameter these passes did reach: the zero-grad checks
        follow the part of the model that trains. Host pass over the parameters, only then."""
        st.misses = 0 if st.saw else st.misses + 1
        if st.misses < 3:
            return
        reached = [p for p in st.comp.index.params if p.requires_grad and p.grad is not None and p is not st.sentinel]
        if reached:
            self.attach(st.comp, sentinel=min(reached, key=lambda p: p.numel()))
        st.misses = 0

    def measure(self, comp: Component, number: int = 0, unscale: bool = True, *,
                scale: torch.Tensor | None | bool = False, sentinel: torch.Tensor | None = None, keep: bool = False) -> Tap:
        """The gradients of ``comp`` now (device tensors; no host read); divided by the scaler's
        scale when ``unscale`` (the backward pass left them scaled), or by ``scale`` when given (None:
        not at all). With ``sentinel``, ``Tap.sentinel`` is the raw (scaled) L2 norm of its gradient:
        taken from the per-tensor norms when the component's norm is their norm (no extra kernel).
        The common case (:attr:`LayerIndex.foreach`) is one kernel (the per-tensor norms; their norm waits
        for :attr:`Tap.total`). ``keep``: the loop clips these gradients, so a pass whose per-tensor norms are
        ``_foreach_norm``'s (unscaled, one optimizer) keeps them, and the gradients, for
        :mod:`~trackdiag.capture.clip_serve`."""
        idx = comp.index
        grads = None
        if not idx.sharded:  # idx.grads() inline on the usual pass (a C-level pass, no frame)
            grads = list(map(GRAD, idx.params))
            if any(map(_is_none, grads)):
                grads = None
        if grads is None:
            grads = idx.grads()
        idx.clear_cache()
        detail = self.detail()
        several = len(comp.optimizers) > 1  # a later optimizer's own pass may be merged in: per-tensor norms kept
        if scale is False:
            scale = self.scale() if unscale else None
        if scale is None and not detail and not several and idx.foreach and len(grads) <= LAZY_TENSORS:
            tap = plain_tap(comp, grads, self.ctx.step, number, sentinel, keep)  # the usual pass: one kernel, few calls
            if tap is not None:
                return tap
        grad_mode = torch.is_grad_enabled()  # a create_graph backward: no graph for these norms
        try:  # set inside the try: a KeyboardInterrupt right after it must not leave grad mode off
            torch._C._set_grad_enabled(False)
            parts = None
            if idx.foreach or detail:
                try:
                    parts = foreach_norms(grads, idx.low_precision)
                except (RuntimeError, NotImplementedError):  # sparse or mixed gradients: the per-tensor way
                    parts = None
            total = norms = None
            # now: on detail steps, with several optimizers (a later pass may be merged in), under a scaler (at
            # this pass's scale), and for many tensors (a window of 0-d norms per tensor would pile up: 50 steps x 3,000 tensors of CUDA blocks); else when asked for
            if parts is not None and (detail or several or scale is not None or len(parts) > LAZY_TENSORS):
                norms = torch.stack(parts).float()
                total = torch.linalg.vector_norm(norms)
            elif parts is None:
                norms = grad_norms(grads, idx.low_precision) if detail or several else None
                total = torch.linalg.vector_norm(norms) if norms is not None else global_norm(grads, idx.low_precision)
            raw = None if sentinel is None or sentinel.grad is None else sentinel_raw(comp, grads, parts, sentinel)
            top = max_abs(grads) if detail else None
            if scale is not None:
                total = total / scale if total is not None else None
                top = top / scale if top is not None else None
            tap = Tap(total, (norms / scale if scale is not None else norms) if detail or several else None, self.ctx.step, number,
                      comp.generation, top, sentinel=raw)
            if total is None:  # worked out when asked for (a window at a time)
                tap.parts, tap.scale = parts, scale
        finally:
            torch._C._set_grad_enabled(grad_mode)
        if detail:
            tap.versions = [g._version for g in grads]
            tap.ids = [id(g) for g in grads]
        if keep and parts is not None and scale is None and not several:  # the loop's clip may read these norms
            tap.parts = list(parts)
            tap.grads, tap.grad_versions = grads, (tap.versions if detail else list(map(VERSION, grads)))
        g = sentinel.grad if sentinel is not None else None
        if g is not None:  # what the step's optimizer must find unchanged (else it looks at the values)
            tap.sentinel_grad, tap.sentinel_version = g, g._version
        return tap

    def sentinel_of(self, name: str) -> torch.Tensor | None:
        """The sentinel parameter of component ``name``, or None."""
        st = self.states.get(name)
        return st.sentinel if st is not None else None

    def scale(self) -> torch.Tensor | None:
        """The ``GradScaler``'s current scale (device tensor), or None without an enabled scaler."""
        scaler = self.ctx.scaler
        if scaler is None or not getattr(scaler, "_enabled", False):
            return None
        scale = getattr(scaler, "_scale", None)
        return scale.to(torch.float32) if isinstance(scale, torch.Tensor) else None

    # ------------------------------------------------------------------ consuming
    def begin_closure(self, name: str) -> None:
        """``optimizer.step(closure)`` started: its first backward is the step's gradient."""
        st = self.states.get(name)
        if st is not None:
            st.in_closure, st.first_in_step = True, None

    def take_latest(self, name: str) -> Tap | None:
        """The newest backward pass's measurement since the last take (then cleared), or None; the
        sentinel's record of the passes stays for the next :meth:`take`."""
        st = self.states.get(name)
        if st is None or st.latest is None or st.latest.generation != st.comp.generation:
            return None
        tap, st.latest = st.latest, None
        tap.grads = tap.grad_versions = None
        return tap

    def take(self, name: str) -> tuple[Tap | None, list[Pass]]:
        """The step's tap (the first one inside a closure step, else the latest since the last
        take) and the backward passes the sentinel saw since then; both are reset."""
        st = self.states.get(name)
        if st is None:
            return None, []
        tap = st.first_in_step if st.in_closure and st.first_in_step is not None else st.latest
        if tap is not None and tap.generation != st.comp.generation:
            tap = self._carry(st, tap)
        if tap is None and st.thin:  # a step without a pass the sentinel saw: one may have reached other layers only
            try:
                params = watched(st.comp)
                with hookable(params):
                    self._hook_layers(st, params)
            except RuntimeError:  # hooked at attach time already: cannot fail here short of a changed parameter
                pass
        st.latest = st.first_in_step = None
        st.in_closure = False
        if tap is not None:  # the clip is behind: the step's gradients are not held past it
            tap.grads = tap.grad_versions = None
        # no backward pass runs while the loop records its step: a pass still marked as started, or a
        # callback still marked queued, was cut short (a KeyboardInterrupt in it); left so, no later
        # pass would be measured
        st.fired = TAP_QUEUE.queued = False
        passes, st.passes = st.passes, []
        return tap, passes

    @staticmethod
    def _carry(st: CompTap, tap: Tap) -> Tap | None:
        """A measurement taken before the component was re-indexed (an optimizer adopted at its first
        step, after the backward pass and the user's clipping): still the step's pre-clip gradient when
        it covered the same parameters; its per-tensor values only if in the same order. None when the
        parameters differ (then the gradients are read again as they are now)."""
        before, now = st.params_of.get(tap.generation), st.params_of.get(st.comp.generation)
        if before is None or now is None or set(before) != set(now):
            return None
        if before != now:
            tap.norms = tap.versions = tap.ids = None
        tap.generation = st.comp.generation
        return tap

    def waiting(self) -> list[tuple[Component, Tap]]:
        """The measurements not taken yet: each component's latest pass since its last :meth:`take`."""
        return [(st.comp, st.latest) for st in self.states.values()
                if st.latest is not None and st.latest.generation == st.comp.generation and not st.in_closure]

    def hooked(self, name: str) -> bool:
        st = self.states.get(name)
        return st is not None and bool(st.handles or st.layer_handles)

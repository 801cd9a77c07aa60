"""How a session follows optimizer steps and hands each step's gradients to the probes.

Mixed into :class:`trackdiag.Diagnostics`. The moment a component's gradients are *consumed* is:
  * the optimizer's step pre-hook, for ``optimizer.step()`` (the usual loop);
  * the step post-hook, for ``optimizer.step(closure)`` (LBFGS, Lightning): the closure runs the
    backward inside ``step()``; the first backward inside it is the one at the step's parameters;
  * ``Diagnostics.step()``, for a component whose optimizer did not step (no optimizer, a hand-
    written update, a ``GradScaler``-skipped step, an optimizer the user stopped calling).
At that moment the gradient probes get a :class:`~trackdiag.capture.grad_records.GradView` whose norms are the
ones the backward pass left (pre-clip, unscaled) and the zero-grad sentinel's record of the passes.

Optimizers are followed through torch's global step hooks (:mod:`trackdiag.capture.optimizers`): any
wrapper works, and an optimizer created after the session is adopted at its first step when it
steps the session's parameters (or explicitly with :meth:`attach`).
"""
from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from trackdiag.capture.components import attachable, groups_signature, reindex, replaced, stateful
from trackdiag.capture.context import Component
from trackdiag.capture.grad_records import GradView, merge_taps
from trackdiag.capture.gradtap import GradTap
from trackdiag.capture.optimizers import DISPATCH, scaler_of, top_lr
from trackdiag.probes.base import Probe
from trackdiag.session.micro_steps import MicroSteps
from trackdiag.util.schedule import NEVER, next_due

log = logging.getLogger("trackdiag")


@dataclass(slots=True)
class _StepState:
    """Where one component is within the optimizer step in progress."""

    depth: int = 0  # nesting of step() calls (a wrapper's inner optimizer)
    stepped: bool = False  # an optimizer step ran
    consumed: bool = False  # the gradients went to the probes
    closure: bool = False
    pre_done: bool = False
    view: GradView | None = None  # what the probes got this step (a later optimizer's own pass is merged into it)
    by: tuple[int, ...] = ()  # the optimizers whose gradients ``view`` holds


class OptimizerEvents(MicroSteps):
    """Optimizer steps and gradient consumption; see the module docstring."""

    components: list[Component]
    probes: list[Probe]
    _replan: Callable[[], None]  # step_plan.StepPlan: the per-step hooks with work change
    _next_check: int  # step_plan.StepPlan: the steps before it (past the anomaly window) are plain steps

    def _init_events(self) -> None:
        ctx = self._ctx
        if ctx.scaler is None:
            ctx.scaler = next((s for c in self.components for g in c.given if (s := scaler_of(g)) is not None), None)
        self._detail_step = -1
        self._detail = False
        self._next_detail = 0  # before it, no gradient probe that wants max |g| and versions is due (step_plan.py)
        self._tap = GradTap(ctx, self._detail_due, self._refresh_groups, self._closure_began)
        ctx.waiting = self._tap.waiting
        for comp in self.components:
            self._tap.attach(comp)
        self._steps: dict[str, _StepState] = {c.name: _StepState() for c in self.components}
        self._foreign: weakref.WeakSet[Any] = weakref.WeakSet()
        self._retired: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers replaced by newer ones (_retire)
        self._init_micro()
        self._notes: dict[str, str] = {}
        self._masks: dict[tuple[str, int, int], torch.Tensor] = {}  # (component, generation, id(optimizer)) -> its params
        # training phases (greedy layer-wise training, progressive unfreezing): an optimizer stepping for the
        # first time after step 0, or parameters joining/leaving training, start one; loss and gradient
        # rules judge each phase against its own history
        self._ever_stepped: set[int] = set()
        self._first_lr: dict[int, float | None] = {}  # id(optimizer) -> its largest learning rate at its first step
        self._phase_pending = False
        self._quiet_first = False  # the next first step is a replacement's that starts no phase (_retire)
        self._phase_ready = False  # set after the first step: what happens during it is the set-up
        self._grad_probes = [p for p in self.probes if type(p).on_grads is not Probe.on_grads]
        self._pre_probes = [p for p in self.probes if type(p).before_optimizer_step is not Probe.before_optimizer_step]
        # the probes each hook calls on a plain step (step_plan.py: worked out with the plan; None until then)
        self._pre_plain: list[Probe] | None = None
        self._post_plain: list[Probe] | None = None
        self._grad_plain: list[Probe] | None = None
        self._post_probes = [p for p in self.probes if type(p).after_optimizer_step is not Probe.after_optimizer_step]
        self._owners: dict[int, Component] = {}  # id(optimizer) -> its component (the component holds the optimizer)
        for comp in self.components:
            comp.groups = groups_signature(comp)
            self._owners.update((id(o), comp) for o in comp.optimizers)
            if not comp.optimizers:
                self._note_no_optimizer(comp)
        DISPATCH.add(self)

    def _note_no_optimizer(self, comp: Component) -> None:
        what = f"component {comp.name!r}" if comp.name else "the model"
        given = f" ({type(comp.given[0]).__name__} runs no torch step hooks)" if comp.given else ""
        note = (f"no optimizer steps {what} yet{given}: gradients are read at the end of each backward pass and "
                f"updates between step() calls; the learning rate is not measured until an optimizer that steps "
                f"these parameters runs (it is adopted then) or is given with diag.attach(optimizer).")
        self._notes[comp.name] = note
        log.warning("trackdiag: %s", note)

    def lr_ramping(self, comps: list[Component]) -> bool:
        """Whether the learning rate the pre-flight's copies start from is a ramp's first value, not the training's:
        0, under a torch scheduler's ``initial_lr`` by half or more (a warm-up), or changed since the optimizer's
        first step (a manual schedule: nanoGPT's ``get_lr``, an LR range test)."""
        for comp in comps:
            for opt in comp.optimizers:
                now = top_lr(opt)
                if now is None:
                    continue
                first = self._first_lr.get(id(opt))
                initial = max((float(g["initial_lr"]) for g in getattr(opt, "param_groups", ()) if "initial_lr" in g), default=None)
                if now == 0.0 or (initial is not None and now < 0.5 * initial) or \
                        (first is not None and abs(now - first) > 0.01 * max(abs(first), 1e-30)):
                    return True
        return False

    def _detail_due(self) -> bool:
        """Does the step in progress need the gradients' max |g| and version counters? (cached per step)"""
        ctx = self._ctx
        if self._detail_step != ctx.step:
            self._detail_step = ctx.step
            if ctx.step < self._next_detail and ctx.step > ctx.anomaly_until:
                self._detail = False  # the step plan: no such probe is due before _next_detail
            else:
                wanting = [p for p in self._grad_probes if p.wants_detail and p.enabled]
                self._detail = any(ctx.is_due(p.schedule) for p in wanting)
                self._next_detail = min((next_due(p.schedule, ctx.step) for p in wanting), default=NEVER)
        return self._detail

    # ------------------------------------------------------------------ public
    def attach(self, optimizer: Any, component: str | None = None) -> None:
        """Follow ``optimizer`` (any wrapper) for ``component`` (default: the one whose parameters
        it steps). Use it when the optimizer is created after the session; optimizers that step the
        session's parameters are also adopted on their own at their first step."""
        comp = next((c for c in self.components if c.name == component), None) if component is not None else \
            next((c for c in self.components if attachable(c, optimizer)), self.components[0] if len(self.components) == 1 else None)
        if comp is None:
            raise ValueError(f"no component for this optimizer; name one of {[c.name for c in self.components]}")
        self._adopt(comp, optimizer)

    def _adopt(self, comp: Component, opt: Any) -> None:
        old = replaced(comp, opt)
        if old is not None:
            self._retire(comp, old, returning=opt in self._retired)
        new = comp.add_optimizer(opt)
        self._find_grad_states()  # a wrapper given now may carry accelerate's gradient state
        if new:
            self._owners.update((id(o), comp) for o in comp.optimizers)
            log.info("trackdiag: following %s for %s", type(opt).__name__, comp.name or "the model")
            self._notes.pop(comp.name, None)
        if self._ctx.scaler is None:
            self._ctx.scaler = scaler_of(opt)
        comp.groups = groups_signature(comp)
        self._reindex(comp)
        self._replan()  # a scaler or an optimizer arrived: the per-step hooks that have work change

    def _refresh_groups(self, comp: Component) -> None:
        """Follow ``add_param_group`` as soon as a backward pass shows it (before it is measured)."""
        comp.refreshed = self._ctx.step
        sig = groups_signature(comp)
        if sig != comp.groups:
            comp.groups = sig
            self._reindex(comp)

    def _reindex(self, comp: Component) -> None:
        if reindex(comp, self.config["max_layer_metrics"]):
            if self._ctx.step > 0 and self._phase_ready:
                self._phase_pending = True  # parameters joined or left training mid-run: a new phase
            self._tap.attach(comp)
            for p in self.probes:
                if p.enabled:
                    self._guard(p, "reindexed", self._ctx, comp)
            self._replan()

    # ------------------------------------------------------------------ torch's global step hooks
    def _adopted(self, opt: Any) -> Component | None:
        """An optimizer not (yet) ours: the component it steps (adopted now), or None."""
        if opt in self._foreign or any(st.depth for st in self._steps.values()):
            return None  # not ours, or the inner optimizer of a wrapper that is stepping
        for comp in self.components:
            if attachable(comp, opt):
                self._adopt(comp, opt)
                return comp
        self._foreign.add(opt)
        return None

    def _retire(self, comp: Component, old: Any, returning: bool = False) -> None:
        """``old`` is replaced by a new optimizer of its class over the same parameters: let it go (a loop that
        builds its optimizer every step would otherwise keep each one, and its state, alive) and count the
        replacement (``optimizer_recreated``). A replacement of an optimizer that stepped once or never, within
        such a streak, does not start a training phase: the loop is the same. An optimizer that steps again after
        being replaced (two kept and alternated) is not a new one: not counted."""
        rec = comp.recreations
        quick = returning or rec.streak > 0 and rec.at == rec.steps - 1 or id(old) not in self._ever_stepped
        if not returning:
            rec.replaced(self._ctx.step, type(old).__name__, stateful(old))
        self._retired.add(old)
        comp.retire(old)
        key = id(old)
        self._owners.pop(key, None)
        self._ever_stepped.discard(key)
        self._first_lr.pop(key, None)
        for k in [k for k in self._masks if k[2] == key]:
            del self._masks[k]
        if quick:
            self._quiet_first = True

    def optimizer_pre_step(self, opt: Any, closure: Any) -> None:
        if self._closed:
            return
        comp = self._owners.get(id(opt)) or self._adopted(opt)  # ours: one look-up (the component keeps it alive)
        if comp is None:
            return
        st = self._steps[comp.name]
        st.depth += 1
        if st.depth > 1:
            return
        t0 = time.perf_counter()
        if comp.refreshed != self._ctx.step:  # add_param_group: follow the new parameters from this step on
            self._refresh_groups(comp)
        comp.recreations.steps += 1
        tapped = self._tap.states.get(comp.name)
        hooked = tapped is not None and bool(tapped.handles or tapped.layer_handles)  # GradTap.hooked inline
        if closure is None and not comp.resteps.failed:  # a closure's own backward passes refresh the gradients inside
            try:
                comp.resteps.observe(opt, self._ctx.step, tapped.count if hooked else -1)
            except Exception as exc:  # noqa: BLE001 - never raise into the user's optimizer step
                comp.resteps.failed = f"{type(exc).__name__}: {exc}"
                self._notes["resteps"] = f"the check for optimizer steps on the same gradients is off: {comp.resteps.failed}"
        if id(opt) not in self._ever_stepped:  # an optimizer's first step after step 0: a new phase begins
            self._ever_stepped.add(id(opt))
            self._first_lr[id(opt)] = top_lr(opt)  # the pre-flight tells a warm-up start from a constant LR by it
            quiet, self._quiet_first = self._quiet_first, False  # the same loop's optimizer, built anew (_retire)
            self._phase_pending = self._phase_pending or (self._ctx.step > 0 and self._phase_ready and not quiet)
        st.stepped = True
        if st.consumed and id(opt) not in st.by and len(comp.optimizers) > 1:
            self._merge(comp, opt)
        if not st.pre_done and (closure is None or st.consumed or not hooked):
            st.pre_done = True
            ctx = self._ctx
            plain = self._pre_plain is not None and self._next_check > ctx.step > ctx.anomaly_until  # _plain_step inline
            self._run(self._pre_plain if plain else self._pre_probes, "before_optimizer_step", comp)
        if closure is not None and not st.consumed:  # the probes before the step: at the closure's first backward
            st.closure = True
            self._tap.begin_closure(comp.name)
        elif not st.consumed:
            self._consume(comp)
            st.by = (id(opt),)
        self._window_overhead += time.perf_counter() - t0

    def _closure_began(self, comp: Component) -> None:
        """The first backward pass inside ``optimizer.step(closure)``: the probes that act before the step run now,
        on the weights the closure evaluated (what the closure did to them before its forward is not the
        optimizer's update: LBFGS style transfer clamps the image to [0, 1] there)."""
        st = self._steps.get(comp.name)
        if st is None or st.pre_done or not st.depth:
            return
        st.pre_done = True
        with torch.no_grad():
            self._run(self._pre_probes, "before_optimizer_step", comp)

    def _merge(self, comp: Component, opt: Any) -> None:
        """Another optimizer of ``comp`` steps after a backward pass of its own since the step's gradients
        were consumed (a critic's update, then the actor's, in one module; Lightning's manual-optimization
        GAN): its parameters' gradients are that pass's, the others' stay what the probes got; the probes
        get the merged view (:meth:`~trackdiag.probes.base.Probe.on_more_grads`)."""
        st = self._steps[comp.name]
        first = st.view
        later = self._tap.take_latest(comp.name)
        st.by += (id(opt),)
        if first is None or later is None or first.source != "backward":
            return
        key = (comp.name, comp.generation, id(opt))
        mask = self._masks.get(key)
        if mask is None:  # which of the component's parameters this optimizer steps: host work, once
            mine = {id(p) for g in getattr(opt, "param_groups", ()) for p in g["params"]}
            mask = torch.tensor([id(p) in mine for p in comp.index.params], dtype=torch.bool)
        tap = merge_taps(first.tap, later, mask)
        if tap is None:
            return
        self._masks[key] = mask.to(tap.total.device)  # moved once (a host-to-device copy waits on CUDA)
        st.view = GradView(comp, tap, "backward", True, first.passes, first.sentinel)
        self._hand(comp, st.view, more=True)

    def optimizer_post_step(self, opt: Any, closure: Any) -> None:
        if self._closed:
            return
        comp = self._owners.get(id(opt))
        if comp is None:
            return
        st = self._steps[comp.name]
        st.depth = max(st.depth - 1, 0)
        ctx = self._ctx
        post = self._post_plain if self._post_plain is not None and self._next_check > ctx.step > ctx.anomaly_until \
            else self._post_probes
        if st.depth or not (post or (st.closure and not st.consumed)):
            return
        t0 = time.perf_counter()
        if st.closure and not st.consumed:
            self._consume(comp)
            st.by = (id(opt),)
        self._run(post, "after_optimizer_step", comp)
        self._window_overhead += time.perf_counter() - t0

    def _run(self, probes: list[Probe], method: str, comp: Component) -> None:
        if not probes:
            return
        ctx = self._ctx
        for p in probes:  # hot path: inline try instead of _guard's getattr per call
            if p.enabled and (not p.due_only or ctx.is_due(p.schedule)):
                try:
                    getattr(p, method)(ctx, comp)
                except Exception as exc:
                    self._fail(p, method, exc)
        comp.index.clear_cache()

    def _consume(self, comp: Component) -> None:
        """The component's gradients for this step go to the gradient probes."""
        st = self._steps[comp.name]
        st.consumed = True
        tap, passes = self._tap.take(comp.name)
        source = "backward"
        if tap is None:  # no backward reached the component since the last step, or the tap is off
            tap, source = self._tap.measure(comp, unscale=False), "step"
        ctx = self._ctx
        view = st.view = GradView(comp, tap, source, st.stepped, passes, self._tap.sentinel_of(comp.name))
        if source == "backward":
            ctx.backward_seen.add(comp.name)
        ctx.passes[comp.name] = len(passes)
        self._hand(comp, view)

    def _hand(self, comp: Component, view: GradView, more: bool = False) -> None:
        """The gradient probes get ``view``: ``on_grads`` at the step's consumption, ``on_more_grads`` after a merge;
        on a plain step only those the step plan keeps (no due-only probe)."""
        ctx = self._ctx
        plain = self._grad_plain is not None and self._next_check > ctx.step > ctx.anomaly_until
        for p in self._grad_plain if plain else self._grad_probes:
            if p.enabled:
                try:
                    (p.on_more_grads if more else p.on_grads)(ctx, comp, view)
                except Exception as exc:
                    self._fail(p, "on_more_grads" if more else "on_grads", exc)
        comp.index.clear_cache()

    # ------------------------------------------------------------------ Diagnostics.step
    def _finish_components(self) -> None:
        """At ``Diagnostics.step``: components nobody consumed get their gradients read now."""
        stepped = set()
        for comp in self.components:  # one loop, no comprehension: a frame less on every step
            st = self._steps[comp.name]
            if not st.consumed:
                self._consume(comp)
            if st.stepped:
                stepped.add(comp.name)
        self._ctx.stepped = stepped

    def _reset_steps(self) -> None:
        self._ctx.backward_seen = set()
        self._ctx.passes = {}
        for st in self._steps.values():
            st.stepped = st.consumed = st.closure = st.pre_done = False
            st.depth, st.view, st.by = 0, None, ()

    def _check_reindex(self) -> None:
        """Logging steps: follow parameters that were unfrozen, added or materialised later."""
        for comp in self.components:
            self._reindex(comp)

    def _stop_events(self) -> None:
        DISPATCH.discard(self)
        self._tap.detach()

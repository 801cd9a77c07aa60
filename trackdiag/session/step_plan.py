"""The step plan: what a non-logging step has to do, worked out once per logging step instead of on every step.

Mixed into :class:`trackdiag.Diagnostics`. A step is a logging step when one of the enabled probes' schedules fires
on it, when it falls in an anomaly window, or (under a stretched cadence, :mod:`trackdiag.session.budget`) when a
window check is due. Schedules are pure functions of the step, so after each step that asked them the plan keeps
the next step any of them fires on (:func:`~trackdiag.util.schedule.next_due`); the steps before it call no
schedule at all, they compare two integers. Reassigning ``_schedules`` or ``_checks`` (a probe disabled, the cost
budget stretching the cadence) drops the plan, and the next step asks the schedules again.

The plan also keeps which probes' ``on_step`` has work to do until the next logging step (:meth:`Probe.quiet`: a
probe whose per-step hook would return at once, such as the AMP probe without an enabled ``GradScaler``, is not
called). It is worked out again after each logging step and whenever the session's shape changes (an optimizer
adopted, parameters re-indexed, a phase begun): :meth:`_replan`. With it, the probes the optimizer hooks call on a plain
step (``_pre_plain``, ``_post_plain``, ``_grad_plain``): not a due-only probe (its schedule cannot fire there), nor one
with nothing to do before the step until the next plan (:meth:`Probe.idle_before_step`).

The probes' own due checks (``ctx.is_due``) read the same plan: before the next logging step a schedule of the plan
is not called (:meth:`_tell`).

The plain path (:meth:`StepPlan._plain`): a step that the plan says is no logging step, with a scalar loss and nothing
pending (no micro-batch, pre-flight or new phase: :meth:`StepPlan._lane_open`, checked after every full step), skips the
questions of ``Diagnostics.step`` whose answer is known and does the same work: the busy probes, the components'
gradients, the counters.

Cost: a non-logging step pays two integer comparisons for the logging decision and one call per busy probe.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from trackdiag.capture.components import batch_size_of
from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import NEVER, next_due


class StepPlan:
    """The logging decision's next step and the busy ``on_step`` probes; see the module docstring."""

    _ctx: ProbeContext
    _on_step: list[Probe]

    def _init_plan(self) -> None:
        self._next_check = 0  # every step up to here asks nothing: not a logging step, no window check
        self._tell(0)
        self._busy: list[Probe] | None = None  # the on_step probes with work to do (None: all, until planned)

    # the schedules that decide logging steps; a new list drops the plan
    @property
    def _schedules(self) -> list[Any]:
        return self.__dict__["_plan_schedules"]

    @_schedules.setter
    def _schedules(self, value: list[Any]) -> None:
        self.__dict__["_plan_schedules"] = value
        self._next_check = self.__dict__["_next_detail"] = 0  # both plans are asked again at the next step
        self._tell(0)

    @property
    def _checks(self) -> list[Any]:
        return self.__dict__.get("_plan_checks", [])

    @_checks.setter
    def _checks(self, value: list[Any]) -> None:
        self.__dict__["_plan_checks"] = value
        self._next_check = self.__dict__["_next_detail"] = 0  # both plans are asked again at the next step
        self._tell(0)

    def _plain_step(self, step: int) -> bool:
        """Whether ``step`` is certainly not a logging step and needs no window check (two comparisons)."""
        return step < self._next_check and step > self._ctx.anomaly_until

    def _plan_after(self, step: int) -> None:
        """After ``step`` asked the schedules: the next step any of them fires on."""
        self._next_check = min((next_due(s, step) for s in (*self._schedules, *self._checks)), default=NEVER)
        self._tell(self._next_check, step + 1)

    def _tell(self, until: int, since: int = 0) -> None:
        """The probes' ``ctx.is_due`` answers the plan's schedules without calling them on the steps from ``since``
        to before ``until`` (not on the step that made the plan: its logging step asks them after the plan)."""
        ctx = self.__dict__.get("_ctx")
        if ctx is not None:
            ctx.quiet_until = 0
            ctx.quiet_from = since
            # every enabled probe's schedule: equal to one of ``_schedules`` (those are deduplicated by equality)
            refs = tuple(p.schedule for p in self.__dict__.get("probes", ()) if p.enabled) if until else ()
            ctx.planned_refs, ctx.planned = refs, frozenset(map(id, refs))
            ctx.quiet_until = until

    def _replan(self) -> None:
        """Which probes' ``on_step`` has work until the next logging step (host work, once per logging step and
        per event). Before the first logging step every probe is called."""
        if "_on_step" not in self.__dict__ or "_ctx" not in self.__dict__:
            return  # an optimizer adopted while the session is being built
        ctx = self._ctx
        busy = []
        for p in self._on_step:
            try:
                if p.enabled and not p.quiet(ctx):
                    busy.append(p)
            except Exception:  # noqa: BLE001 - a probe that cannot tell stays busy
                busy.append(p)
        self._busy = busy
        # the optimizer hooks' probes on a plain step: a due-only probe is not due there (every enabled probe's
        # schedule is one of the plan's), nor is a probe with nothing to do before the step until the next plan
        pre = []
        for p in self.__dict__.get("_pre_probes", ()):
            try:
                if p.enabled and not p.due_only and not p.idle_before_step(ctx):
                    pre.append(p)
            except Exception:  # noqa: BLE001 - a probe that cannot tell stays busy
                pre.append(p)
        self._pre_plain = pre
        self._post_plain = [p for p in self.__dict__.get("_post_probes", ()) if p.enabled and not p.due_only]
        self._grad_plain = [p for p in self.__dict__.get("_grad_probes", ()) if p.enabled and not p.due_only]

    def _busy_probes(self) -> list[Probe]:
        return self._on_step if self._busy is None else self._busy

    def _lane_open(self) -> bool:
        """Whether the next steps may take :meth:`_plain`: the session open and past its first step, the pre-flight
        settled, no micro-batch losses pending, the step plan made (checked again after every full step)."""
        return (self._opened and self._t_first is not None and self._preflighted and self._held_fit is None
                and not self._micro and self._phase_ready and self._busy is not None)

    def _plain(self, t0: float, ctx: ProbeContext, loss: torch.Tensor, outputs: Any, batch: Any,
               batch_size: int | None) -> bool:
        """:meth:`step` on a plain step (its caller checked, and :meth:`_lane_open` after the last full one): what
        :meth:`step` does there, without the questions whose answer is known (a dict of losses, a pre-flight, a new
        phase, the schedules). The step's objective is not observed again: one unnamed loss, as before or new, sets
        nothing (:meth:`Objectives.observe`)."""
        if self._gaps is not None:  # the cost budget's measure of the loop
            self._gaps.append(t0 - self._t_last)
        if batch_size is None:  # batch_size_of's usual cases inline: a tensor, or a tuple or list led by one
            first = batch[0] if type(batch) in (tuple, list) and batch else batch
            if type(first) is torch.Tensor:
                batch_size = int(first.shape[0]) if first.ndim else None
            elif batch is not None:
                batch_size = batch_size_of(batch)
        inputs = StepInputs({"": loss}, outputs, batch, batch_size)
        self._finish_components()
        for p in self._busy:
            if p.enabled:
                try:
                    p.on_step(ctx, inputs)
                except Exception as exc:
                    self._fail(p, "on_step", exc)
        self._reset_steps()
        self._step += 1
        ctx.step = self._step
        self._t_last = time.perf_counter()
        self._window_overhead += self._t_last - t0
        return self.should_stop

"""The :class:`Probe` contract. Every hook is a documented no-op here."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext, StepInputs

if TYPE_CHECKING:
    from trackdiag.capture.grad_records import GradView
from trackdiag.core.record import Record
from trackdiag.util.schedule import Every


class Probe:
    """Computes one family of diagnostics.

    Life cycle per optimizer step: ``before_optimizer_step`` / ``after_optimizer_step`` (from the
    optimizer's step hooks, per component), then ``on_step`` (from ``Diagnostics.step``). On a
    logging step where the probe is due, ``collect`` returns device tensors (never ``.item()``);
    the session copies all probes' tensors to the host at once and hands the host arrays to
    ``publish``, which writes metric keys into the record.

    Args:
        enabled: switch the probe off without removing its config.
        every: logging cadence in optimizer steps; ``None`` means the session's ``every``.
    """

    name: ClassVar[str] = ""
    #: collect at every logging step even when not due (a probe with per-step buffers to flush)
    always_collect: ClassVar[bool] = False
    #: also run on every step of an anomaly window (False for probes too costly to run every step)
    follows_anomaly: ClassVar[bool] = True
    #: the optimizer-step hooks only act on due steps: the session skips the call on other steps
    due_only: ClassVar[bool] = False
    #: ``on_grads`` reads the gradients' max |g| / version counters on its due steps (the tap takes them)
    wants_detail: ClassVar[bool] = False

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        self.enabled = enabled
        self.every = every
        self.schedule = Every(every or 1, type(self).follows_anomaly)

    def bind(self, default_every: int) -> None:
        """Called by the session once its cadence is known."""
        self.schedule = Every(self.every or default_every, type(self).follows_anomaly)

    def attach(self, ctx: ProbeContext) -> None:
        """Register hooks or allocate buffers. Default: nothing."""

    def detach(self) -> None:
        """Undo ``attach``. Default: nothing."""

    def before_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        """The first optimizer step pre-hook of ``comp`` in this step (parameters not yet updated;
        gradients possibly clipped). Default: nothing."""

    def on_grads(self, ctx: ProbeContext, comp: Component, view: "GradView") -> None:
        """Once per step and component, when the step consumes the gradients: ``view.norms`` are
        the pre-clip norms the backward pass left (see :class:`~trackdiag.capture.grad_records.GradView`).
        Every step: must cost at most a few device ops off due steps. Default: nothing."""

    def on_more_grads(self, ctx: ProbeContext, comp: Component, view: "GradView") -> None:
        """After :meth:`on_grads`, in the same step: another optimizer of ``comp`` stepped its parameters
        after a backward pass of its own (a critic's update, then the actor's, in one module); ``view`` holds
        the step's gradients, each parameter's as its own optimizer found it. Default: nothing."""

    def reindexed(self, ctx: ProbeContext, comp: Component) -> None:
        """``comp.index`` was rebuilt (param groups added, layers unfrozen): drop per-component
        caches. Default: nothing."""

    def after_optimizer_step(self, ctx: ProbeContext, comp: Component) -> None:
        """Parameters are updated here. Default: nothing."""

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        """Every step; must cost at most a few device ops. Default: nothing."""

    def quiet(self, ctx: ProbeContext) -> bool:
        """Whether :meth:`on_step` has nothing to do until the next logging step, or the next change of the
        session's shape (an optimizer or a scaler adopted, parameters re-indexed): then the step plan does
        not call it (:mod:`trackdiag.session.step_plan`). Default: it always has work."""
        return False

    def idle_before_step(self, ctx: ProbeContext) -> bool:
        """Like :meth:`quiet`, for :meth:`before_optimizer_step`: whether it has nothing to do until the next logging
        step or change of the session's shape (then the optimizer hook does not call it). Default: it has work."""
        return False

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        """Device tensors (or host numbers) to copy to the host at this logging step."""
        return {}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        """Write host values into ``record``. Default: each value as a scalar under its own key."""
        for k, v in values.items():
            record.scalars[k] = float(v.reshape(-1)[0])

    def after_record(self, ctx: ProbeContext, record: Record) -> None:
        """The logging step's record, complete and judged by the rules (alerts in ``record.alerts``
        not yet: they are applied after). Default: nothing."""

    def finish(self, ctx: ProbeContext, record: Record) -> None:
        """At the end of the run, after the local record is complete on disk (``ctx.output_dir``):
        write end-of-run artifacts and add their paths to ``record.artifacts``. Default: nothing."""

    def state_dict(self) -> dict[str, Any]:
        """State a resumed run must keep (EMAs, counters)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``."""


def take_pending(pending: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per-component device tensors in ``collect``'s layout, ``"<component>|<key>"``; empties ``pending``."""
    out = {f"{c}|{k}": v for c, d in pending.items() for k, v in d.items()}
    pending.clear()
    return out

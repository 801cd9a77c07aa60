"""Set-up checks a session offers besides the per-step diagnostics: timing the data loader and the
sanity pre-flight. Mixed into :class:`trackdiag.Diagnostics`."""
from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from trackdiag.capture.context import StepInputs
from trackdiag.capture.isolation import replaying
from trackdiag.capture.user_loss import skipped
from trackdiag.core.errors import AlertRaised, brief
from trackdiag.core.record import Record
from trackdiag.forensics.preflight import PreflightReport, run_preflight
from trackdiag.probes.data_wait import DataWaitProbe
from trackdiag.rules.preflight import Preflight

log = logging.getLogger("trackdiag")


class SetupChecks:
    """``wrap_loader`` and ``preflight``; relies on the session's probes, rules, components and ``_emit``."""

    def wrap_loader(self, loader: Any) -> Any:
        """``loader`` wrapped so the ``data_wait`` probe times each batch fetch (``data_bottleneck``);
        ``loader`` itself when that probe is off. Host clock only."""
        probe = next((p for p in self.probes if p.enabled and isinstance(p, DataWaitProbe)), None)
        return probe.wrap(loader) if probe is not None else loader

    def _captured_forward(self) -> Any:
        """``forward(model, batch)`` replaying the step's first captured forward call, or None."""
        from trackdiag.probes.nan_replay import NanReplayProbe

        probe = next((p for p in self.probes if p.enabled and isinstance(p, NanReplayProbe)), None)
        calls = probe.calls_of(self._ctx.step) if probe is not None else []
        if not calls:
            return None
        call = replaying(*calls[0][:2])  # a generator passed to the forward: the trial's draws leave it as it was
        return lambda model, batch: call(model)

    def preflight(self, batch: Any, loss_fn: Any = None, *, forward: Any = None, component: str | None = None,
                  auto: bool = False, reference: float | None = None) -> PreflightReport:
        """Sanity checks of the set-up on one batch (see :mod:`trackdiag.forensics.preflight`), on copies of the
        models and optimizers; each failed check is emitted as a ``preflight`` alert. The loss: the
        session's ``loss_fn(batch)`` (every model at once) unless ``loss_fn(outputs, batch)`` or
        ``forward(model, batch)`` (default ``model(batch[0])``) is given here. Returns the report."""
        self._preflighted = True
        if not self._opened:
            self._open()
        rule = self._preflight_rule()
        comps = [c for c in self.components if component in (None, c.name) and c.model is not None]
        if not comps:
            return PreflightReport()
        batch_loss = self._ctx.loss_fn if loss_fn is None and forward is None else None
        parts = [(c.name, c.model, c.optimizers or c.optimizer) for c in comps] if batch_loss is not None else None
        report = run_preflight(comps[0].model, comps[0].optimizers or comps[0].optimizer, batch, loss_fn or rule.loss_fn, forward,
                               overfit_steps=rule.overfit_steps, overfit_drop=rule.overfit_drop, lenient=auto,
                               batch_loss=batch_loss, parts=parts, reference=reference, ramp=self.lr_ramping(comps))
        held = [c for c in report.failed if c.slow] if auto and self._step == 0 else []
        now = [c for c in report.failed if c not in held]
        if held:  # the learning rate of the next step tells a schedule's first value from a constant one
            self._held_fit = (held, self._step, comps, len(now))
        record = Record(step=self._step, time=time.time(), scalars={"diag/preflight/failed": float(len(now))})
        raised = self._emit(record, [(rule, a) for a in report.alerts(self._step, rule.pinned, rule.hint, now)])
        if raised is not None:
            raise AlertRaised(raised)
        return report

    def _preflight_rule(self) -> Preflight:
        """The session's ``preflight`` rule (its severity, hint, options), or one with the defaults."""
        return next((r for r in self.rules if isinstance(r, Preflight)), None) or Preflight()

    def _settle_fit(self) -> None:
        """The automatic pre-flight's one-batch fit that failed at so small a learning rate that the weights
        barely moved (``Check.slow``), judged at the next step: a rate that moved since the optimizer's first
        step (an LR range test that sets each rate before its step, as fastai's does; a warm-up stepped by
        hand) was a schedule's first value: inconclusive, said once; a rate that did not move is the failure,
        named at the pre-flight's step. Also at close (a run of one step)."""
        held, step, comps, failed = self._held_fit
        self._held_fit = None
        if self.lr_ramping(comps):
            log.info("trackdiag: pre-flight: the one-batch fit ran at the first value of a learning-rate schedule (the "
                     "rate moved at the next step): inconclusive")
            return
        rule = self._preflight_rule()
        record = Record(step=self._step, time=time.time(), scalars={"diag/preflight/failed": float(failed + len(held))})
        raised = self._emit(record, [(rule, a) for a in PreflightReport(held).alerts(step, rule.pinned, rule.hint)])
        if raised is not None and not self._closed:
            raise AlertRaised(raised)

    def _auto_preflight(self, inputs: StepInputs) -> None:
        """``rules.preflight.auto``: the pre-flight on the first step's batch, calling the model the way
        the step did (its captured forward arguments: hidden states, masks, keywords); a pre-flight
        that cannot call the model or guess the loss is a note, not a fault (``diag.preflight`` with
        ``forward=``/``loss_fn=`` runs it for real)."""
        self._preflighted = True
        if inputs.batch is not None and any(isinstance(r, Preflight) and r.enabled and r.auto for r in self.rules):
            user = self._ctx.loss_fn is not None
            forward = None if user else self._captured_forward()
            loss = inputs.losses.get("") if len(inputs.losses) == 1 else None
            # without the user's loss_fn, the step's own loss on this batch tells whether a guessed loss is the one
            # being trained (a host read at the first step only); called another way than the step did, no check of
            # the training is possible
            reference = None if user else (float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1
                                           and forward is not None else math.nan)
            try:
                report = self.preflight(inputs.batch, forward=forward, auto=True, reference=reference)
            except AlertRaised:
                raise
            except Exception as exc:  # noqa: BLE001
                log.warning("trackdiag: pre-flight could not run: %s", brief(exc))
                return
            log.info("trackdiag: pre-flight\n%s", report)
            forward = next((c for c in report.checks if c.name == "forward"), None)
            if not user and forward is not None and (forward.ok is None or "surrogate" in forward.detail):
                why = forward.detail.rstrip(".") if forward.ok is None else \
                    "no loss follows from the model's outputs and the batch; its loss checks ran on a surrogate"
                skipped(self._ctx, "pre-flight", why)


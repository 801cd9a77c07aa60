"""Evaluation results recorded at the training step they follow (:meth:`Evaluations.log_eval`).

Mixed into :class:`trackdiag.Diagnostics`: its record is judged by the rules' ``check_eval`` (overfitting, an
evaluation in the wrong mode, an evaluation batch that is a training batch) and sent like a logging step's.
"""
from __future__ import annotations

import time
from typing import Any

from trackdiag.capture.context import ProbeContext
from trackdiag.core.errors import AlertRaised
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe


class Evaluations:
    """:meth:`log_eval`; see the module docstring."""

    _ctx: ProbeContext
    _step: int
    _opened: bool
    probes: list[Probe]
    _eval_probes: list[Probe]  # the probes that implement on_eval

    def log_eval(self, loss: Any = None, *, batch: Any = None, **metrics: Any) -> None:
        """Record evaluation results (``diag/eval/loss``, ``diag/eval/<name>``) at the current step.

        Values must be real numbers or one-element tensors (read back here: one host sync each);
        any other value is skipped with one warning naming its key, never an exception. ``batch``: an
        evaluation batch (optional): compared with the recent training batches (``eval_on_train_batch``).
        """
        from trackdiag.util.eval_values import eval_scalars

        if isinstance(batch, (int, float)) and not isinstance(batch, bool):  # a metric named "batch", as before
            metrics["batch"], batch = batch, None
        values = eval_scalars(loss, metrics)
        if not values:
            return
        if not self._opened:
            self._open()
        step = max(self._step - 1, 0)
        record = Record(step=step, time=time.time())
        for k, v in values.items():
            record.scalars[f"diag/eval/{k}"] = v
        for p in self._eval_probes:  # what they saw of the evaluation (the eval_mode probe: the models' calls)
            if p.enabled:
                self._guard(p, "on_eval", self._ctx, record)
        if batch is not None:  # the probes that fingerprint training batches say whether it is one of them
            for p in self.probes:
                if p.enabled and hasattr(p, "on_eval_batch"):
                    self._guard(p, "on_eval_batch", self._ctx, batch, record)
        alerts = self._judge("check_eval", record, self._history)
        raised = self._emit(record, alerts)
        if raised is not None:
            raise AlertRaised(raised)

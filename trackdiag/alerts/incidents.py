"""A non-finite incident and its consequences: after the loss goes NaN, the dead units, vanishing
gradients, divergence and the rest that follow are not new faults.

An incident opens with the first non-finite alert (``nonfinite_input``, ``_loss``, ``_grad`` or
``_param``, in that order of precedence at one step) and lasts until a record is entirely finite
again. ``nonfinite_input`` (the cause, when the data holds NaN) is always emitted; of loss, grad and
param only the first (the symptom the replay locates); every alert that describes training
dynamics during the incident is counted as suppressed, not emitted. Alerts about the set-up and the
data (``INDEPENDENT``) and anything before the incident's first step still are.
"""
from __future__ import annotations

import math

from trackdiag.alerts.book import INDEPENDENT
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record

NONFINITE = ("nonfinite_input", "nonfinite_loss", "nonfinite_grad", "nonfinite_param")


def nonfinite(record: Record) -> bool:
    """Whether anything in ``record`` is NaN/Inf (loss or gradient series, counts of bad tensors)."""
    if any(not math.isfinite(v) for pts in record.series.values() for _, v in pts):
        return True
    return any(v != 0 for k, v in record.scalars.items() if k.endswith(("nonfinite_tensors", "nonfinite_steps")))


def order(alert: Alert) -> tuple[int, int]:
    """Sort key: by step, the non-finite kinds first (input, loss, grad, param) within a step."""
    return alert.step, NONFINITE.index(alert.kind) if alert.kind in NONFINITE else len(NONFINITE)


class Incidents:
    """See module docstring."""

    def __init__(self) -> None:
        self.since: int | None = None
        self.chain: str | bool = False  # the loss/grad/param kind the open incident emitted

    def screen(self, alert: Alert) -> bool:
        """True to emit ``alert``; False when it is a consequence of the open incident."""
        if alert.kind in NONFINITE:
            if alert.kind == "nonfinite_input":
                self.since = alert.step if self.since is None else self.since
                self.chain = False
                return True
            if self.since is None or not self.chain:
                self.since = alert.step if self.since is None else self.since
                self.chain = alert.kind
                return True
            return alert.step < self.since or alert.kind == self.chain  # a repeat: the cooldown's business
        return self.since is None or alert.step < self.since or alert.kind in INDEPENDENT

    def update(self, record: Record) -> None:
        """Close the incident once a training record is entirely finite again (an evaluation record,
        which holds no training values, says nothing about it)."""
        training = bool(record.series) or any(not k.startswith("diag/eval/") for k in record.scalars)
        if self.since is not None and training and not nonfinite(record) and record.step > self.since:
            self.since, self.chain = None, False

"""Optuna trials that stop themselves on trackdiag's alerts (Optuna 5; ``pip install 'trackdiag[optuna]'``).

Use it from any objective::

    def objective(trial):
        lr = trial.suggest_float("lr", 1e-4, 1.0, log=True)
        ...
        with watch_trial(trial, planned_steps=steps):      # watches every session opened inside
            with trackdiag.Diagnostics(model, opt) as diag:
                for step in range(steps):
                    ...
                    if diag.step(loss):                     # True once the trial is stopped
                        break
            return val_loss

When the session emits an alert of a severity or kind in ``stop_on`` (default: ``critical``), the
stopper writes the alert into the trial's user attributes (``trackdiag.stop.*``, ``trackdiag.stopped``), sets the
session's ``should_stop`` (``step()`` returns True at that very step) and, when the ``with`` block
ends, raises :class:`optuna.TrialPruned` (``on_stop="prune"``) or :class:`TrialStopped`
(``on_stop="fail"``: Optuna records the trial FAIL; pass ``catch=(TrialStopped,)`` to ``optimize``).
A loop that ignores ``should_stop`` gets the exception from its next ``step()``. The training loss
is reported to the trial every ``report_every`` steps (default: the session's ``every``) so Optuna's
own pruners work; ``use_pruner=True`` stops the trial when ``trial.should_prune()`` says so.

Costs: a Python wrapper around ``step()``; one host read of the loss at reporting steps (those are
the session's logging steps by default, which read it anyway); a look at the alert list per step; one
storage write per session (``trackdiag.run_dir``: the run's local record, for ``trackdiag compare optuna:``).
The run's local record gets ``trial.json`` (the study, trial number, params, and the stop), which
``trackdiag compare`` shows next to the run's health.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

from trackdiag.core import watchers
from trackdiag.core.errors import TrackdiagError

log = logging.getLogger("trackdiag")

SEVERITIES = ("info", "warning", "critical")
ON_STOP = ("prune", "fail")
TRIAL_FILE = "trial.json"
RUN_DIR_ATTR = "trackdiag.run_dir"  # the trial's user attribute naming its run's local record


class TrialStopped(TrackdiagError):
    """A trial stopped by trackdiag with ``on_stop="fail"``; ``stop`` says which alert and when."""

    def __init__(self, message: str, stop: "Stop") -> None:
        super().__init__(message)
        self.stop = stop


@dataclass
class Stop:
    """Why and when a trial was stopped. ``alert_step``: the step the alert is about;
    ``stop_step``: the last step the trial trained; ``steps_saved``/``seconds_saved``: against
    ``planned_steps`` (None when unknown), seconds at the trial's own mean step time so far."""

    kind: str
    severity: str
    message: str
    alert_step: int
    stop_step: int
    steps_run: int
    planned_steps: int | None
    steps_saved: int | None
    seconds_saved: float | None

    def reason(self) -> str:
        return f"trackdiag {self.severity} {self.kind} at step {self.alert_step}: {self.message}"


def check_stop_on(stop_on: Iterable[str]) -> list[str]:
    """``stop_on`` as a list; raises ValueError naming a bad entry (a severity or an alert kind)."""
    if isinstance(stop_on, str):
        stop_on = [stop_on]
    out = list(stop_on)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_on: {s!r} is not a severity ({', '.join(SEVERITIES)}) or an alert kind")
    return out


class TrialStopper:
    """Stops an Optuna ``trial`` on the alerts of the sessions it watches (see the module doc).

    Args:
        trial: the ``optuna.Trial`` (anything with ``report``, ``should_prune``, ``set_user_attr``).
        stop_on: severities and/or alert kinds that stop the trial; ``critical`` (default) also
            stops on nothing milder. Empty: never stop on alerts (reporting only).
        on_stop: ``prune`` (``optuna.TrialPruned``) or ``fail`` (:class:`TrialStopped`).
        planned_steps: the steps the trial would run, for ``steps_saved``.
        report_every: report the training loss every N steps (None: the session's ``every``; 0: never).
        use_pruner: stop when the study's pruner says ``should_prune()`` after a report.
    Raises:
        ValueError: a bad ``on_stop``/``stop_on``/``report_every``.
    """

    def __init__(self, trial: Any, stop_on: Iterable[str] = ("critical",), *, on_stop: str = "prune",
                 planned_steps: int | None = None, report_every: int | None = None, use_pruner: bool = True) -> None:
        if on_stop not in ON_STOP:
            raise ValueError(f"on_stop: {on_stop!r}; accepted: {', '.join(ON_STOP)}")
        if report_every is not None and (not isinstance(report_every, int) or report_every < 0):
            raise ValueError(f"report_every: {report_every!r} is not a step count >= 0 (or None)")
        self.trial, self.stop_on, self.on_stop = trial, check_stop_on(stop_on), on_stop
        self.planned_steps, self.report_every, self.use_pruner = planned_steps, report_every, use_pruner
        self.stopped: Stop | None = None
        self.sessions: list[Any] = []
        self._seen: dict[int, int] = {}
        self._t0: float | None = None

    # ------------------------------------------------------------------ attaching
    def watch(self, diag: Any) -> Any:
        """Watch ``diag`` (wraps its ``step`` and ``log_eval``); returns it. Costs: nothing until a step."""
        if any(s is diag for s in self.sessions):
            return diag
        self.sessions.append(diag)
        self._seen[id(diag)] = len(diag.alerts)
        step, log_eval = diag.step, diag.log_eval

        def watched_step(loss: Any = None, **kw: Any) -> bool:
            if self.stopped is not None:  # the loop went on after step() returned True
                raise self.exception()
            if self._t0 is None:
                self._t0 = time.perf_counter()
            out = step(loss, **kw)
            n = getattr(diag, "global_step", 0) - 1
            self._report(diag, n, loss)
            self._judge(diag, n)
            return bool(out) or self.stopped is not None

        def watched_eval(loss: Any = None, **metrics: Any) -> None:
            log_eval(loss, **metrics)
            self._judge(diag, max(getattr(diag, "global_step", 1) - 1, 0))

        diag.step, diag.log_eval = watched_step, watched_eval
        self._write(diag)
        run = getattr(diag, "run", None)
        if run is not None:  # so `trackdiag compare optuna:<storage>#<study>` finds the trial's record
            self.trial.set_user_attr(RUN_DIR_ATTR, str(Path(run.output_dir).resolve()))
        return diag

    def __enter__(self) -> "TrialStopper":
        watchers.watch(self.watch)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        watchers.unwatch(self.watch)
        if exc is None and self.stopped is not None:
            raise self.exception()

    # ------------------------------------------------------------------ deciding
    def matches(self, alert: Any) -> bool:
        """Whether ``alert`` stops the trial: its kind is listed, or its severity is a listed one or worse."""
        if alert.kind in self.stop_on:
            return True
        listed = [SEVERITIES.index(s) for s in self.stop_on if s in SEVERITIES]
        return bool(listed) and alert.severity in SEVERITIES and SEVERITIES.index(alert.severity) >= min(listed)

    def _judge(self, diag: Any, step: int) -> None:
        alerts = diag.alerts
        new, self._seen[id(diag)] = alerts[self._seen.get(id(diag), 0):], len(alerts)
        if self.stopped is None:
            for a in new:
                if self.matches(a):
                    self._stop(diag, step, a.kind, a.severity, a.message, int(a.step))
                    return

    def _report(self, diag: Any, step: int, loss: Any) -> None:
        every = self.report_every if self.report_every is not None else int(getattr(diag, "every", 0) or 0)
        if not every or step < 0 or step % every or loss is None or isinstance(loss, dict) or self.stopped:
            return
        try:
            value = float(loss.detach() if hasattr(loss, "detach") else loss)  # one host read, at a step the session logs anyway (default cadence)
        except (TypeError, ValueError, RuntimeError):
            return
        if not math.isfinite(value):
            return  # Optuna's pruners compare values; a NaN is the rules' business
        self.trial.report(value, step)
        if self.use_pruner and self.trial.should_prune():
            self._stop(diag, step, "optuna_pruner", "info", f"the study's pruner at step {step} (loss {value:.4g})", step)

    def _stop(self, diag: Any, step: int, kind: str, severity: str, message: str, alert_step: int) -> None:
        run = step + 1
        saved = max(self.planned_steps - run, 0) if self.planned_steps is not None else None
        per_step = (time.perf_counter() - self._t0) / run if self._t0 is not None and run > 0 else None
        seconds = round(saved * per_step, 3) if saved is not None and per_step is not None else None
        self.stopped = Stop(kind, severity, message, alert_step, step, run, self.planned_steps, saved, seconds)
        diag.should_stop = True
        for k, v in asdict(self.stopped).items():
            self.trial.set_user_attr(f"trackdiag.stop.{k}", v)
        self.trial.set_user_attr("trackdiag.stopped", True)
        log.warning("trackdiag: stopping Optuna trial %s: %s", getattr(self.trial, "number", "?"), self.stopped.reason())
        for d in self.sessions:
            self._write(d)

    def exception(self) -> BaseException:
        """The exception that ends a stopped trial: ``optuna.TrialPruned`` or :class:`TrialStopped`."""
        if self.stopped is None:
            raise RuntimeError("exception(): the trial was not stopped")
        if self.on_stop == "fail":
            return TrialStopped(self.stopped.reason(), self.stopped)
        import optuna

        return optuna.TrialPruned(self.stopped.reason())

    def _write(self, diag: Any) -> None:
        """``trial.json`` in the run's local record: study, trial number, params, the stop (or null)."""
        run = getattr(diag, "run", None)
        if run is None:
            return
        trial = self.trial
        study = getattr(getattr(trial, "study", None), "study_name", None)
        doc = {"study": study, "number": getattr(trial, "number", None), "params": dict(getattr(trial, "params", {})),
               "on_stop": self.on_stop, "stop_on": self.stop_on,
               "stopped": asdict(self.stopped) if self.stopped else None}
        try:
            run.output_dir.mkdir(parents=True, exist_ok=True)
            (run.output_dir / TRIAL_FILE).write_text(json.dumps(doc, indent=1, default=str))
        except OSError as exc:
            log.warning("trackdiag: could not write %s: %s", run.output_dir / TRIAL_FILE, exc)


def watch_trial(trial: Any, diag: Any = None, **options: Any) -> TrialStopper:
    """A :class:`TrialStopper` for ``trial`` (``options``: its keyword arguments), watching ``diag``
    if given and, used as a context manager, every session opened inside the ``with`` block."""
    stopper = TrialStopper(trial, **options)
    if diag is not None:
        stopper.watch(diag)
    return stopper

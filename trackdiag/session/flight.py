"""The flight recorder's exit path, mixed into :class:`trackdiag.Diagnostics`: when the user's script
dies mid-step of an exception (or is killed by SIGTERM), ONE ``crash`` alert (critical) goes into the
local record, the console and the trackers before the sinks close: the exception (first line), the
step that was running, the module whose output first went non-finite in that step (see
:mod:`trackdiag.probes.flight`) or, failing that, the module whose ``forward`` raised, the last steps
of the loss and the pre-clip gradient norm, and remedies that fit. Ctrl-C (KeyboardInterrupt), a
normal end, ``sys.exit(0)`` and a rule's own ``raise`` action give none; the run's status and the
exception itself are never changed or swallowed.

The exception reaches the session from its ``with`` block (``__exit__``), an ``except``/``finally``
that calls ``close()``, ``sys.excepthook``/``threading.excepthook`` (a script without ``with``, closed
at exit), SIGTERM, a framework callback (Lightning's ``on_exception``) or the Hydra job callback: see
:mod:`trackdiag.util.exit_status`. Also here: the ``loss_fn`` property (:mod:`trackdiag.capture.user_loss`).
Cost: nothing per step; at a crash, a traceback walk, a read of the records in memory and at most one
forward replay (none after an out-of-memory or CUDA error, SIGTERM, or an optimizer step).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

from trackdiag.capture.layers import ROOT
from trackdiag.capture.user_loss import checked
from trackdiag.core.alert import Alert
from trackdiag.core.errors import AlertRaised, brief
from trackdiag.core.record import Record
from trackdiag.forensics import crash_evidence
from trackdiag.forensics.crash import (
    crash_hint,
    last_points,
    module_in,
    no_replay,
    nonfinite_text,
    series_text,
    stack_frames,
    tables_of,
    tb_frames,
    tb_lines,
    user_line,
)
from trackdiag.forensics.replay import Finding
from trackdiag.forensics.replay_hints import replay_hint
from trackdiag.probes._replay_report import input_note
from trackdiag.probes.flight import FlightProbe
from trackdiag.probes.lr import LrProbe
from trackdiag.rules.updates import UpdateRatio
from trackdiag.util import exit_status
from trackdiag.util.modnames import module_type

log = logging.getLogger("trackdiag")


class FlightRecorder:
    """See module docstring. Relies on the session's probes, components, ``_ctx``, ``_history``,
    ``_steps``, ``_book`` and ``_hub``."""

    @property
    def loss_fn(self) -> Any:
        """The user's loss computation ``loss_fn(batch) -> loss`` (None: not given)."""
        return self._ctx.loss_fn  # type: ignore[attr-defined]

    @loss_fn.setter
    def loss_fn(self, fn: Any) -> None:
        self._ctx.loss_fn = checked(fn)  # type: ignore[attr-defined]

    def _note_exit(self, exc: BaseException | None) -> None:
        """``__exit__``: remember the exception ending the ``with`` block for the crash finding."""
        exit_status.note(self, exc)

    def _report_crash(self, status: str) -> None:
        """At close, before the sinks close: the ``crash`` finding, once, when the run dies of an
        exception or SIGTERM (see module docstring). Never raises."""
        if getattr(self, "_crash_done", False) or status == exit_status.FINISHED:
            return
        self._crash_done = True
        exc = exit_status.exception(self)
        signalled = exit_status.signalled()
        if isinstance(exc, (KeyboardInterrupt, AlertRaised)) or (exc is None and not signalled):
            return
        if isinstance(exc, SystemExit) and not signalled and exc.code in (0, None):
            return
        probe = next((p for p in self.probes if p.enabled and isinstance(p, FlightProbe)), None)  # type: ignore[attr-defined]
        if probe is None:
            return
        try:
            alert, tables = self._crash_alert(probe, exc, signalled)
        except Exception as err:  # noqa: BLE001 - the diagnosis must never hide the user's exception
            log.warning("trackdiag: the crash finding could not be made: %s", brief(err))
            return
        record = Record(step=alert.step, time=time.time(), tables=tables)
        if self._book.admit(alert, 0):  # type: ignore[attr-defined]
            record.alerts.append(alert)
        log.warning("trackdiag: %s", alert.describe())
        self._hub.write(record)  # type: ignore[attr-defined]
        for a in record.alerts:
            self._hub.alert(a)  # type: ignore[attr-defined]

    def _crash_alert(self, probe: FlightProbe, exc: BaseException | None, signalled: bool) -> tuple[Alert, dict[str, Any]]:
        ctx = self._ctx  # type: ignore[attr-defined]
        step = ctx.step
        comps = [c for c in self.components if c.model is not None]  # type: ignore[attr-defined]
        names = {id(m): (c.name, n or ROOT) for c in comps for n, m in c.model.named_modules()}
        frames = tb_frames(exc.__traceback__) if exc is not None else []
        lines: list[int] | None = tb_lines(exc.__traceback__) if exc is not None else None
        raised = module_in(frames, names)
        if signalled and raised is None:
            frames, lines = stack_frames(exit_status.signal_frame()), None
            raised = module_in(frames, names)
        comp, found, finite_seen = self._nonfinite(probe, exc, signalled)
        multi = len(comps) > 1
        model = next((c.model for c in comps if c.name == comp), None)
        head = "killed by SIGTERM" if signalled else brief(exc) if exc is not None else "ended"
        points = last_points(self._history, probe.last)  # type: ignore[attr-defined]
        evidence = [] if signalled or no_replay(exc) == "out of memory" else self._evidence(step, points, probe.last, multi)
        parts = [crash_evidence.lead(evidence)] if evidence else []
        parts.append(f"The run stopped at step {step}: {head.rstrip('.')}.")
        where = ""
        if found is not None and found.located:
            where = found.where(comp if multi else "", module_type(model, found.module))
            label = "Flight recorder" if found.phase == "observed" else "Replay at the crash"
            parts.append(f"{label} of step {step}: {found.detail}")
        elif found is not None and found.detail:
            parts.append(f"Non-finite values: {found.detail}")
        if raised is not None:
            rcomp, rname, rmod = raised
            full = f"{rcomp}.{rname}" if multi and rcomp else rname
            verb = "was running when the signal arrived" if signalled else "raised it"
            parts.append(f"The forward of {full} ({type(rmod).__name__}) {verb}.")
            where = where or f"{full} ({type(rmod).__name__}, {'running' if signalled else 'raised'} in its forward)"
        line = user_line(frames, lines)
        if line:
            parts.append(f"Last line of the training script: {line}.")
        made = self._inplace_origin(exc, signalled)
        if made is not None:
            mcomp, (path, lineno, func, code, module) = made
            spot = f"{os.path.basename(path)}:{lineno}"
            named = ""
            if module is not None:
                owner = next((c.model for c in comps if c.name == mcomp), None)
                full = (f"{mcomp}.{module}" if module else mcomp) if multi and mcomp else (module or ROOT)
                named = f"{full} ({module_type(owner, module) if module else type(owner).__name__})"
            parts.append(f"Replayed under anomaly detection: the tensor changed in place was made at {spot} in {func}"
                         f"{f' of {named}' if named else ''}: `{code}`. An in-place operation on it after that line "
                         f"(+=, *=, .add_(), .relu_(), x[i] = ..., ReLU(inplace=True)) broke the backward.")
            where = where or (f"{named}, {spot}" if named else spot)
        series = series_text(points)
        parts.append(f"Last steps: {series}." if series else "No step of the every-step series was recorded yet.")
        if found is not None and found.located:
            probe_alert = Alert("nonfinite_loss", step, "critical", "", where=where)
            hint = (f"A NaN/Inf made the script fail ({type(exc).__name__ if exc is not None else 'exit'}). "
                    + replay_hint(found, probe_alert, where, data=False))
        else:
            hint = crash_hint(exc, signalled, finite_seen)
        if evidence and ((found is not None and found.located) or nonfinite_text(exc)):  # the weights blew up
            hint = crash_evidence.hint(evidence, where, hint)
        return Alert("crash", step, "critical", " ".join(parts), where=where, hint=hint), tables_of(points)

    def _inplace_origin(self, exc: BaseException | None, signalled: bool) -> Any:
        """For a crash of autograd's in-place check, the NaN replay's answer to where the tensor was made (see
        :mod:`trackdiag.forensics.inplace`), else None."""
        from trackdiag.forensics.inplace import is_inplace_error, origin_at_crash
        from trackdiag.probes.nan_replay import NanReplayProbe

        if signalled or not is_inplace_error(exc) or any(st.stepped for st in self._steps.values()):  # type: ignore[attr-defined]
            return None
        nan = next((p for p in self.probes if p.enabled and isinstance(p, NanReplayProbe)), None)  # type: ignore[attr-defined]
        return origin_at_crash(nan, self._ctx) if nan is not None else None  # type: ignore[attr-defined]

    def _evidence(self, step: int, points: dict[str, list[tuple[int, float]]], last: int,
                  multi: bool) -> list[crash_evidence.Evidence]:
        """What the session held or saw before the crash (:mod:`trackdiag.forensics.crash_evidence`): update_ratio's
        held step, the learning rates logged and in ``param_groups`` now (a few Python reads), the every-step series.
        Never raises: no evidence rather than no finding."""
        try:
            window = max(last, 10)
            held = [h for r in self.rules if r.enabled and isinstance(r, UpdateRatio) for h in r.held()]  # type: ignore[attr-defined]
            now = {k: float(v) for k, v in LrProbe().collect(self._ctx).items()}  # type: ignore[attr-defined]
            return (crash_evidence.updates(held, step, window, multi)
                    + crash_evidence.lr_jumps(self._history, now, step, window)  # type: ignore[attr-defined]
                    + crash_evidence.series(points))
        except Exception as err:  # noqa: BLE001 - a broken device or optimizer must not cost the finding
            log.debug("trackdiag: no crash evidence: %s", brief(err))
            return []

    def _nonfinite(self, probe: FlightProbe, exc: BaseException | None,
                   signalled: bool) -> tuple[str, Finding | None, bool]:
        """``(component, finding, every recorded output was finite)`` for the step in progress: the
        real step's flags first, else a forward replay of its captured calls on the current weights."""
        from trackdiag.probes.nan_replay import NanReplayProbe

        ctx = self._ctx  # type: ignore[attr-defined]
        step = ctx.step
        if probe.flags is not None:
            seen = probe.flags.first_bad(step, running=True)
            if seen is not None:
                (comp, module), inp, calls, bad = seen
                return comp, Finding(step, "observed", module, inp, (
                    f"the first non-finite output of the step's forward came out of {module}{input_note(inp)} ({bad} "
                    f"of the {calls} module outputs recorded in that step held NaN/Inf).")), False
        recorded = probe.flags.recorded(step, running=True) if probe.flags is not None else 0
        if recorded:  # the real step was watched: no replay needed
            return "", Finding(step, "none", detail=f"all {recorded} module outputs recorded in step {step}'s own "
                                                    f"forward were finite."), True
        stepped = any(st.stepped for st in self._steps.values())  # type: ignore[attr-defined]
        nan = next((p for p in self.probes if p.enabled and isinstance(p, NanReplayProbe)), None)  # type: ignore[attr-defined]
        why = ("SIGTERM" if signalled else no_replay(exc) or ("the optimizer had already stepped" if stepped else "")
               or ("" if probe.replay and nan is not None else "no replay"))
        if not why and nan is not None:
            got = nan.running(ctx)
            if got is not None and (got[1].located or got[1].phase == "none"):
                comp, found = got
                if found.phase == "none":  # forward finite: say so, no culprit
                    return comp, dataclasses.replace(found, detail=f"a replay of step {step}'s forward on its weights "
                                                                   f"was finite in every module output."), True
                return comp, found, False
        return "", None, False

"""How a session ends, mixed into :class:`trackdiag.Diagnostics`: ``close()`` sends the last partial
window (or, after a Ctrl-C inside a logging step, what that step had collected), the crash finding
(:mod:`trackdiag.session.flight`), the probes' end-of-run artifacts, then closes the sinks with the run's status
and :meth:`summary`. Also ``flush()``. Nothing here runs per step."""
from __future__ import annotations

import atexit
import gc
import time
from typing import Any

from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.sinks.console import say
from trackdiag.util import exit_status
from trackdiag.util.ranks import is_main_process
from trackdiag.util.uninterrupted import uninterrupted


class RunEnd:
    """``close``, ``flush``, ``summary``; see the module docstring."""

    def summary(self) -> dict[str, Any]:
        """Per alert kind: count, first step, where, suppressed; steps seen; health; overhead."""
        wall = (self._t_last - self._t_first) if self._t_first is not None else 0.0
        spent = self._overhead + self._window_overhead + self._ctx.hook_seconds
        return {
            "enabled": True, "level": self.config["level"], "run_name": self.run.name, "steps": self._step,
            "health": self._book.health(), "alerts": {k: dict(v) for k, v in self._book.kinds.items()},
            "overhead": {"seconds": spent, "per_step_ms": 1e3 * spent / max(self._step, 1),
                         "fraction": spent / wall if wall > 0 else 0.0,
                         "sink_thread_cpu_seconds": self._hub.cpu_seconds},
            "budget": self._budget_summary(),
            "should_stop": self.should_stop, "disabled_probes": dict(self._disabled),
            "notes": [*self._notes.values(), *self._ctx.notes.values()],
            "consequences_suppressed": dict(self._book.consequences),
            "incidents": self._book.summary(),
            "objectives": self.objectives.summary(), "phases": self._ctx.phase + 1,
            "output_dir": str(self.run.output_dir),
        }

    def flush(self) -> None:
        """Block until the sinks have handled everything sent so far."""
        self._hub.drain()

    def close(self, status: str | None = None, timeout: float | None = None) -> None:
        """Flush the last partial window, remove every hook and close the sinks. Idempotent.

        ``status``: ``FINISHED`` | ``FAILED`` | ``KILLED``; None (and at exit): how the run is ending
        (an exception being handled or left uncaught: FAILED, KeyboardInterrupt/SIGTERM: KILLED, see
        :mod:`trackdiag.util.exit_status`). ``timeout``: seconds to wait for the sinks; None: as long as
        their own limits allow (MLflow: ``close_timeout``). Raises ValueError for another status.

        A KeyboardInterrupt while closing (a second Ctrl-C) skips the end-of-run pictures and report
        and the wait for the trackers, but the last window's record, the status and the summary still
        reach every sink (the local record's ``run.json`` says KILLED, not RUNNING); what the trackers
        have not received stays spooled for ``trackdiag sync``. Then the KeyboardInterrupt propagates.
        """
        if self._closed:
            return
        status = exit_status.current(self) if status is None else status
        if status not in (exit_status.FINISHED, exit_status.FAILED, exit_status.KILLED):
            raise ValueError(f"status: {status!r} is not one of FINISHED, FAILED, KILLED")
        self._closed = True
        self._plainly = False  # a step() after close takes the full path
        atexit.unregister(self.close)
        if status == exit_status.KILLED:
            atexit.register(_skip_the_final_collection)
        self._stop_events()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if (self._opened and isinstance(exit_status.exception(self), KeyboardInterrupt) and is_main_process()
                and any(s.name == "console" for s in self._hub.sinks)):  # said at once: the report takes a while
            say("trackdiag: training stopped; ending the run (Ctrl-C again skips the report and the wait for "
                "trackers: nothing is lost)")
        again = None  # a second Ctrl-C while the run is being wound down
        try:
            with uninterrupted():  # a second Ctrl-C skips the report, never the last window's record
                self._last_records(status)
        except KeyboardInterrupt as exc:
            again = exc
        self._settle()
        for p in self.probes:  # every probe lets go of the user's model, whatever else was cut short
            try:
                self._guard(p, "detach")
            except KeyboardInterrupt as exc:
                again = again or exc
        if not self._opened:
            if again is not None:
                raise again
            return
        if again is None:
            try:
                self._finish()
            except KeyboardInterrupt as exc:
                again = exc
        if again is not None:  # the status and summary still reach every sink; trackers keep the rest spooled
            self._hub.interrupt()
            timeout = 5.0 if timeout is None else min(timeout, 5.0)
        self._hub.close(status, {**self.summary(), "status": status}, timeout)
        if again is not None:
            raise again

    def _last_records(self, status: str) -> None:
        """The last partial window (or what an interrupted logging step had collected), findings
        still waiting for steps that will not come, and the crash finding."""
        if self._held_fit is not None and self._opened:  # a run of one step: the pre-flight's fit, judged now
            self._settle_fit()
        if self._unsent is not None and self._logging is not None:  # a Ctrl-C inside a logging step
            unsent, self._unsent = self._unsent, None
            if isinstance(unsent, Record):  # measured: sent as far as it got, unjudged
                self._hub.write(unsent)
                self._last_logged = self._logging
            else:  # cut short while the probes collected: the others collect now, and the record is judged
                self._log(self._logging, final=True, resume=unsent)
        last = self._step - 1 if self._logging is None else self._logging  # interrupted while logging
        if self._opened and last > self._last_logged:
            self._log(last, final=True)
        elif self._opened and self._step > 0:  # findings still waiting for steps that will not come
            last = Record(step=self._step - 1, time=time.time())
            pending = self._judge("at_close", last, self._history, self.components)
            if pending:
                self._emit(last, pending)
        if self._opened:
            self._report_crash(status)  # an exception or SIGTERM: the crash finding (flight.py)

    def _finish(self) -> None:
        """End-of-run artifacts: probes read the complete local record and add files."""
        finishers = [p for p in self.probes if p.enabled and type(p).finish is not Probe.finish]
        if not finishers or not is_main_process():
            return
        self._hub.drain()  # the local record is complete on disk before anyone reads it
        record = Record(step=max(self._step - 1, 0), time=time.time())
        for p in finishers:
            self._guard(p, "finish", self._ctx, record)
        if record.artifacts or record.scalars:
            self._hub.write(record)


def _skip_the_final_collection() -> None:
    """At exit after Ctrl-C or SIGTERM, someone waits for the prompt or a grace period runs out:
    Python's last garbage collections over a heap holding torch and mlflow take ~1 s here (3 s on a
    busy 2-core machine). Freezing the heap skips them; objects are still freed by reference count,
    only cycles left at exit are not collected (Python never promises their ``__del__`` at exit).
    Registered by ``close()`` of a KILLED run; runs only if the interpreter is exiting."""
    gc.freeze()

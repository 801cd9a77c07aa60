"""Flight recorder probe: what a ``crash`` finding (and a NaN culprit that a replay cannot reproduce)
needs, kept without a host read on non-logging steps.

When the user's script dies mid-step (an exception, SIGTERM), the session's exit path
(:mod:`trackdiag.session.flight`) writes one ``crash`` alert: the exception, the step, the last ``last`` steps
of the every-step series (loss, pre-clip gradient norm: already kept on the device by the ``loss``
and ``grads`` probes and flushed into the record at close) and the module whose output first went
non-finite in the step that was running. That module comes from, in order:

  * ``modules: true``: per-module output flags recorded in the real forward of every step
    (:mod:`trackdiag.capture.output_flags`): exact even for a fault that happens once, for a model trackdiag
    cannot call itself (a LightningModule without ``forward``), and for a script that died before any
    replay could run. The same flags name the culprit of a ``nonfinite_*`` alert when the NaN replay
    cannot reproduce the fault;
  * ``replay: true`` and the ``nan_replay`` probe on: a replay, at the crash, of the running step's
    captured forward on the current weights (the optimizer has not stepped since that forward; no
    replay after an out-of-memory error, a CUDA error, SIGTERM, or when the optimizer already stepped);
  * the traceback: the innermost module whose ``forward`` was running when the exception was raised.

Emits no metric key (the crash is an alert; the flags only travel in the logging step's host copy).
Cost: none per step without ``modules``; with it (:mod:`trackdiag.capture.output_flags`), a few microseconds
of host work per module call, and the flags themselves (a sum per module output on the CPU, one
multi-tensor kernel on CUDA) only on steps not judged healthy by the NaN replay's ``mode=step`` (every step
without it) and on the logging steps that learn which modules are non-finite on healthy steps too (the first 3,
then every 10th); at logging steps the flags travel in the one host copy
(docs/crash-and-replay.md). On: ``extreme`` (``modules``), every preset (the rest).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from trackdiag.alerts.incidents import nonfinite
from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.capture.output_flags import OutputFlags
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.probes._replay_report import FLAGS_KEY
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Every, Never

#: habitual non-finite modules are learned from the first LEARN_FIRST logging steps, then every LEARN_EVERY-th
LEARN_FIRST, LEARN_EVERY = 3, 10


class FlightProbe(Probe):
    """See module docstring.

    Args:
        modules: record per-module non-finite flags in every training forward.
        last: steps of each every-step series written into the ``crash`` finding.
        replay: at a crash, replay the running step (needs the ``nan_replay`` probe) when the flags
            did not locate a non-finite output.
    """

    name = "flight"

    def __init__(self, *, enabled: bool = True, every: int | None = None, modules: bool = False, last: int = 10,
                 replay: bool = True) -> None:
        super().__init__(enabled=enabled, every=every)
        if not isinstance(last, int) or last < 1:
            raise ConfigError([f"diag.probes.flight.last: must be an integer >= 1, got {last!r}"])
        self.modules, self.last, self.replay = bool(modules), last, bool(replay)
        self.flags: OutputFlags | None = None
        self._ring = 2
        self._host: tuple[int, np.ndarray] | None = None
        self._logged = 0  # logging steps seen (see _learning)

    def bind(self, default_every: int) -> None:
        n = self.every or default_every
        self._ring = n + 1
        self.schedule = Every(n, False) if self.modules else Never()  # never the reason for a logging step

    def attach(self, ctx: ProbeContext) -> None:
        if self.modules and not ctx.compiled:
            self.flags = OutputFlags(ctx, self._ring)
            self.flags.start()
            ctx.extra[FLAGS_KEY] = self.flags
        elif self.modules:
            ctx.notes["flight"] = ("flight recorder: the model is compiled, so no per-module output flags are "
                                   "recorded (the crash finding keeps the series and the traceback).")

    def detach(self) -> None:
        if self.flags is not None:
            self.flags.stop()

    def stop_modules(self, ctx: ProbeContext) -> None:
        """The cost budget's first shed (:mod:`trackdiag.session.budget_policy`): no more per-module output flags (the crash
        finding keeps the series, the replay of the running step and the traceback)."""
        self.detach()
        self.flags, self.modules, self.schedule = None, False, Never()
        ctx.extra.pop(FLAGS_KEY, None)

    def quiet(self, ctx: ProbeContext) -> bool:
        return self.flags is None

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self.flags is not None:
            self.flags.end_step(ctx.step, due=ctx.is_due(self.schedule) and self._learning())

    def _learning(self) -> bool:
        """Whether this logging step's flags are read even when the step was judged healthy: at the first
        ``LEARN_FIRST`` logging steps, then at every ``LEARN_EVERY``-th (which modules are non-finite on healthy
        steps too is a property of the model, not of the step; a flush costs a few microseconds per module
        call, ~1 ms per logging step on a 65-call seq2seq)."""
        n = self._logged
        self._logged += 1
        return n < LEARN_FIRST or n % LEARN_EVERY == 0

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        got = self.flags.device_flags(ctx.step) if self.flags is not None else None
        return {"flags": got} if got is not None else {}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        self._host = (ctx.step, values["flags"]) if "flags" in values else None  # no metric key

    def after_record(self, ctx: ProbeContext, record: Record) -> None:
        """A healthy logging step: modules whose output was non-finite anyway are never blamed."""
        if self._host is not None and self.flags is not None and not nonfinite(record):
            self.flags.learn(*self._host)
        self._host = None

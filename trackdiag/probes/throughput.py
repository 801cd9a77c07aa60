"""Throughput probe: ``diag/perf/step_time_ms`` (mean wall time per optimizer step since the last
log) and ``diag/perf/samples_per_s`` (when the batch size is known). Host clock only."""
from __future__ import annotations

import time
from typing import Any

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.probes.base import Probe


class ThroughputProbe(Probe):
    name = "throughput"

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._t0: float | None = None
        self._steps = 0
        self._samples = 0

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._t0 is None:  # the first step's duration is unknown: start the clock here
            self._t0 = time.perf_counter()
            return
        self._steps += 1
        if inputs.batch_size:
            self._samples += inputs.batch_size

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        if self._t0 is None or self._steps == 0:
            return {}
        now = time.perf_counter()
        dt = now - self._t0
        out: dict[str, Any] = {"diag/perf/step_time_ms": 1e3 * dt / self._steps}
        if self._samples:
            out["diag/perf/samples_per_s"] = self._samples / dt
        self._t0, self._steps, self._samples = now, 0, 0
        return out

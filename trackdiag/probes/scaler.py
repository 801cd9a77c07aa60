"""AMP ``GradScaler`` dynamics: backoffs (= skipped steps), growths, the lowest scale, backoff streaks.

A step whose gradients hold Inf/NaN is skipped by ``scaler.step`` (``optimizer.step`` is never
called) and ``scaler.update`` halves the scale: every backoff is one skipped step. The scale tensor
(``scaler._scale``, not ``get_scale()``, which syncs) is copied into a device ring buffer at every
``Diagnostics.step``; the whole window reaches the host with the other diagnostics and is read there.
As a cross-check, optimizer-step hook calls are counted against ``Diagnostics.step`` calls.

Emits (when a scaler is enabled), per logging window:
  ``diag/amp/backoffs``: scale decreases = skipped steps; ``diag/amp/growths``: scale increases;
  ``diag/amp/skip_fraction``: backoffs / steps in the window; ``diag/amp/window_steps``;
  ``diag/amp/scale_min``: lowest scale in the window; ``diag/amp/backoff_streak``: longest run of
      consecutive backoffs in the window (a run carried over from the previous window counts whole);
  table ``diag/amp/backoff_steps`` = ``{"first_backoff": step, "streak_start": step}`` when any backoff;
  ``diag/amp/steps_without_optimizer``: ``Diagnostics.step`` calls with no optimizer step since the
      previous one (equals ``backoffs`` when the loop calls ``step`` once per optimizer step).
Cost: one device ``copy_`` of a scalar per step; a few host operations on the logging step.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe


class ScalerProbe(Probe):
    """See module docstring."""

    name = "scaler"
    always_collect = True  # the ring holds every step since the last log

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._buf: torch.Tensor | None = None
        self._n = 0
        self._prev: float | None = None  # last scale of the previous window (host)
        self._streak = 0
        self._no_opt = 0
        self._start: torch.Tensor | None = None
        self._streak_start = -1
        self._steps: list[int] = []  # the step of each ring slot (host)
        self._win_steps: list[int] = []

    def attach(self, ctx: ProbeContext) -> None:
        scale = getattr(ctx.scaler, "_scale", None) if ctx.scaler is not None else None
        self._start = scale.detach().clone().reshape(()) if scale is not None else None  # a resumed scaler

    def quiet(self, ctx: ProbeContext) -> bool:
        scaler = ctx.scaler  # found when an optimizer is adopted (the plan is made again then)
        return scaler is None or not scaler.is_enabled()

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        scaler = ctx.scaler
        scale = getattr(scaler, "_scale", None) if scaler is not None else None
        if scale is None or not scaler.is_enabled():
            return
        if self._prev is None:
            self._prev = float(getattr(scaler, "_init_scale", 2.0**16))  # host number, no sync
        if self._buf is None or self._buf.device != scale.device or self._n >= self._buf.numel():
            grown = torch.empty(max(16, 2 * self._n), dtype=torch.float32, device=scale.device)
            if self._buf is not None and self._n:
                grown[: self._n].copy_(self._buf[: self._n])
            self._buf = grown
        self._buf[self._n].copy_(scale.detach().reshape(()))
        self._n += 1
        self._steps.append(ctx.step)
        if not ctx.stepped:  # no optimizer ran in this step (the step hooks saw none)
            self._no_opt += 1

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        if self._buf is None or self._n == 0:
            return {}
        out = {"scales": self._buf[: self._n].clone(), "no_opt": float(self._no_opt)}
        if self._start is not None:
            out["start"], self._start = self._start, None
        self._n = self._no_opt = 0
        self._win_steps, self._steps = self._steps, []
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        scales = values.get("scales")
        if scales is None or self._prev is None:
            return
        if "start" in values:
            self._prev = float(values["start"][0])
        prev = np.concatenate([[self._prev], scales[:-1]])
        down, up = scales < prev, scales > prev
        longest, streak, start, events = 0, self._streak, self._streak_start, {}
        for step, d in zip(self._win_steps, down.tolist(), strict=True):
            if d and streak == 0:
                start = step
            streak = streak + 1 if d else 0
            if streak > longest:
                longest, events["streak_start"] = streak, float(start)
            if d and "first_backoff" not in events:
                events["first_backoff"] = float(step)
        self._streak, self._streak_start, self._prev = streak, start, float(scales[-1])
        if events:
            record.tables["diag/amp/backoff_steps"] = events
        n = len(scales)
        record.scalars.update({
            "diag/amp/backoffs": float(down.sum()), "diag/amp/growths": float(up.sum()),
            "diag/amp/skip_fraction": float(down.sum()) / n, "diag/amp/window_steps": float(n),
            "diag/amp/scale_min": float(scales.min()), "diag/amp/backoff_streak": float(longest),
            "diag/amp/steps_without_optimizer": float(values["no_opt"][0]),
        })

    def state_dict(self) -> dict[str, Any]:
        return {"prev": self._prev, "streak": self._streak, "streak_start": self._streak_start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev, self._streak = state.get("prev"), int(state.get("streak", 0))
        self._streak_start = int(state.get("streak_start", -1))

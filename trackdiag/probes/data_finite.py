"""The ``data_finite`` probe, fed by the ``batch=`` passed to ``Diagnostics.step``.

``data_finite`` (NaN/Inf in the batch) emits:
  ``diag/data/nonfinite_first_step``: first step of the window whose batch held a NaN/Inf (-1: none);
  ``diag/data/nonfinite_tensors``: (tensor, step) pairs with a NaN/Inf in the window;
  tables ``diag/data/nonfinite_first`` / ``diag/data/nonfinite_count``: the same per batch entry
  (``batch[0]``, ``batch['image']``), so the rule can say where.
  ``diag/data/inputs_constant_steps``: how many steps in a row, up to the window's last, the model input (the
  batch itself, ``batch[0]`` or ``batch['input']``...) held one value everywhere (its minimum equal to its maximum:
  a batch of zeros; 0: the last one varied), ``diag/data/inputs_constant_first_step`` (-1: none) and
  ``diag/data/inputs_constant_value`` (that value), and ``diag/data/input_absmax``: the largest magnitude of the
  model input over the window (images divided by 255 twice stay under 0.004); read from the same ``aminmax``.
  Cost per step and floating tensor of the batch: one ``aminmax`` reduction (NaN propagates, Inf
  shows) kept by reference; the window is stacked, copied with everything else and judged on the
  host at the logging step (exact first step, no per-step sync).
It collects at every logging step (``always_collect``), so no step of a window is lost.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.norms import stack_scalars
from trackdiag.util.tensors import INPUT_KEYS, float_tensors

#: a batch that is a short tuple or list of plain tensors (``(x, y)``): its paths as :func:`float_tensors` names them
_PATHS = tuple(f"batch[{i}]" for i in range(8))
_PLAIN = {torch.Tensor}


class DataFiniteProbe(Probe):
    """See module docstring (``data_finite``). Per step and float tensor of the batch: one
    ``aminmax`` (min/max propagate NaN and show Inf; no batch-sized temporary) whose result is kept
    by reference; the window is stacked and judged on the host at the logging step."""

    name = "data_finite"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._seen: dict[str, list[tuple[int, tuple[torch.Tensor, ...]]]] = {}  # path -> [(step, its values)]
        self._input = "batch"  # the path of the model input in the batch (inputs_of)
        self._constant = InputValues()

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        batch = inputs.batch
        if batch is None:
            return
        if isinstance(batch, torch.Tensor):  # the common cases without the generic walk
            found = [("batch", batch)] if batch.is_floating_point() or batch.is_complex() else []
            self._input = "batch"
        elif type(batch) in (tuple, list) and len(batch) <= len(_PATHS) and set(map(type, batch)) == _PLAIN:
            found = []
            for i, t in enumerate(batch):  # a loop, not a comprehension: a frame less on every step
                if t.is_floating_point() or t.is_complex():
                    found.append((_PATHS[i], t))
            self._input = "batch[0]"
        else:
            found = float_tensors(batch)
            self._input = input_path(batch)
        for path, t in found:
            if t.numel() == 0:
                continue
            if t.requires_grad:
                t = t.detach()  # cheaper per step than entering no_grad
            seen = self._seen.get(path)
            if seen is None:
                seen = self._seen[path] = []
            # one append per step (a Ctrl-C between two would leave steps and values apart)
            seen.append((ctx.step, (torch.view_as_real(t).sum(),) if t.is_complex() else torch.aminmax(t)))

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        out = {}
        self._steps = {}
        for path, seen in self._seen.items():
            self._steps[path] = [step for step, _ in seen]
            out[path] = stack_scalars([v for _, vals in seen for v in vals])
        self._seen = {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        first: dict[str, int] = {}
        count: dict[str, int] = {}
        for path, host in values.items():
            steps = self._steps[path]
            finite = np.isfinite(host.reshape(len(steps), -1)).all(axis=1)
            bad = [s for s, ok in zip(steps, finite) if not ok]
            if bad:
                first[path], count[path] = bad[0], len(bad)
            if path == self._input and host.size == 2 * len(steps):  # (min, max) per step; a complex input has a sum
                self._constant.feed(steps, host.reshape(len(steps), 2))
        if self._input in values:
            self._constant.publish(record, self._input)
        record.scalars["diag/data/nonfinite_first_step"] = float(min(first.values())) if first else -1.0
        record.scalars["diag/data/nonfinite_tensors"] = float(sum(count.values()))
        if first:
            record.tables["diag/data/nonfinite_first"] = {k: float(s) for k, s in first.items()}
            record.tables["diag/data/nonfinite_count"] = {k: float(n) for k, n in count.items()}


def input_path(batch: Any) -> str:
    """The path (as :func:`~trackdiag.util.tensors.float_tensors` names it) of the model input of ``batch``."""
    if isinstance(batch, Mapping):
        key = next((k for k in INPUT_KEYS if k in batch), None)
        return f"batch[{key!r}]" if key is not None else ""
    return "batch[0]" if isinstance(batch, (list, tuple)) else "batch"


class InputValues:
    """What each step's ``(min, max)`` of the model input tells: the run of consecutive steps, continued across
    windows, whose input held one value everywhere (``constant_inputs``: its length, first step and value) and the
    window's largest magnitude (a tiny input: images divided by 255 twice)."""

    def __init__(self) -> None:
        self.steps, self.first, self.value = 0, -1, math.nan
        self.absmax = math.nan

    def feed(self, steps: list[int], minmax: np.ndarray) -> None:
        finite = minmax[np.isfinite(minmax).all(axis=1)]
        self.absmax = float(np.abs(finite).max()) if finite.size else math.nan
        for step, (lo, hi) in zip(steps, minmax.tolist()):
            if lo == hi and math.isfinite(lo):  # NaN != NaN: a NaN batch is nonfinite_input's
                if not self.steps or lo != self.value:
                    self.steps, self.first, self.value = 0, step, lo
                self.steps += 1
            else:
                self.steps, self.first, self.value = 0, -1, math.nan

    def publish(self, record: Record, path: str) -> None:
        record.scalars["diag/data/inputs_constant_steps"] = float(self.steps)
        record.scalars["diag/data/inputs_constant_first_step"] = float(self.first)
        if math.isfinite(self.absmax):
            record.scalars["diag/data/input_absmax"] = self.absmax
        if self.steps:
            record.scalars["diag/data/inputs_constant_value"] = self.value
            record.tables["diag/data/inputs_constant"] = {path: self.value}

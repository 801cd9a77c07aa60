"""Data probes, fed by the ``batch=`` (and ``outputs=``) passed to ``Diagnostics.step``.

``data_finite`` (NaN/Inf in the batch) emits:
  ``diag/data/nonfinite_first_step``: first step of the window whose batch held a NaN/Inf (-1: none);
  ``diag/data/nonfinite_tensors``: (tensor, step) pairs with a NaN/Inf in the window;
  tables ``diag/data/nonfinite_first`` / ``diag/data/nonfinite_count``: the same per batch entry
  (``batch[0]``, ``batch['image']``), so the rule can say where.
  Cost per step and floating tensor of the batch: one ``aminmax`` reduction (NaN propagates, Inf
  shows) kept by reference; the window is stacked, copied with everything else and judged on the
  host at the logging step (exact first step, no per-step sync).

``data_labels`` (class targets outside the model's classes) emits:
  ``diag/data/label_first_bad_step`` (-1: none), ``diag/data/label_bad_steps``,
  ``diag/data/label_min`` / ``diag/data/label_max`` (over the window, ``ignore_index`` excluded),
  ``diag/data/num_classes`` (from the output's class dimension).
  The targets are ``batch[1]`` / ``batch['target']`` ... (option ``target``: index or key); the
  number of classes is the class dimension of the output (option ``output``: index or key of a
  structured output) when the shapes pair up (``(N, C)`` with ``(N,)``, ``(B, T, C)`` with
  ``(B, T)``, ``(N, C, H, W)`` with ``(N, H, W)``); otherwise nothing is checked.
  Cost per step: one ``aminmax`` over the targets (plus ``ne``/``where`` to mask ``ignore_index``),
  kept by reference; the window is stacked, copied with everything else and judged on the host.
Both collect at every logging step (``always_collect``), so no step of a window is lost.
"""
from __future__ import annotations

import numpy as np
import torch

from trackdiag.context import ProbeContext, StepInputs
from trackdiag.norms import stack_scalars
from trackdiag.probes.base import Probe
from trackdiag.record import Record
from trackdiag.tensors import class_dim, float_tensors, logits_of, targets_of

class DataFiniteProbe(Probe):
    """See module docstring (``data_finite``). Per step and float tensor of the batch: one
    ``aminmax`` (min/max propagate NaN and show Inf; no batch-sized temporary) whose result is kept
    by reference; the window is stacked and judged on the host at the logging step."""

    name = "data_finite"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._seen: dict[str, tuple[list[int], list[torch.Tensor]]] = {}

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        batch = inputs.batch
        if isinstance(batch, torch.Tensor):  # the common cases without the generic walk
            found = [("batch", batch)] if batch.is_floating_point() or batch.is_complex() else []
        else:
            found = float_tensors(batch)
        for path, t in found:
            if t.numel() == 0:
                continue
            if t.requires_grad:
                t = t.detach()  # cheaper per step than entering no_grad
            seen = self._seen.get(path)
            if seen is None:
                seen = self._seen[path] = ([], [])
            seen[0].append(ctx.step)
            if t.is_complex():
                seen[1].append(torch.view_as_real(t).sum().reshape(1))
            else:
                seen[1].extend(torch.aminmax(t))

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        out = {}
        self._steps = {}
        for path, (steps, vals) in self._seen.items():
            self._steps[path] = steps
            out[path] = stack_scalars(vals)
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
        record.scalars["diag/data/nonfinite_first_step"] = float(min(first.values())) if first else -1.0
        record.scalars["diag/data/nonfinite_tensors"] = float(sum(count.values()))
        if first:
            record.tables["diag/data/nonfinite_first"] = {k: float(s) for k, s in first.items()}
            record.tables["diag/data/nonfinite_count"] = {k: float(n) for k, n in count.items()}


class DataLabelsProbe(Probe):
    """See module docstring (``data_labels``). Args: ``target`` index/key of the targets in the
    batch; ``output`` index/key of the class scores in a structured output; ``ignore_index`` label
    value that is skipped (cross-entropy's default -100; ``None``: none)."""

    name = "data_labels"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, target: int | str | None = None,
                 output: int | str | None = None, ignore_index: int | None = -100) -> None:
        super().__init__(enabled=enabled, every=every)
        self.target, self.output, self.ignore_index = target, output, ignore_index
        self._seen: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (step, classes, lo, hi)
        self._window: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # the collected steps and classes
        self._classes = -1

    @torch.no_grad()
    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        t = targets_of(inputs.batch, self.target)
        logits = logits_of(inputs.outputs, self.output) if t is not None else None
        dim = class_dim(logits, t) if logits is not None and t is not None else None
        if dim is None or t is None or logits is None or t.numel() == 0:
            return
        self._classes = int(logits.shape[dim])
        if self.ignore_index is not None:
            t = torch.where(t != self.ignore_index, t, 0)  # 0 is always a valid class
        lo, hi = torch.aminmax(t.reshape(-1))
        self._seen.append((ctx.step, self._classes, lo, hi))

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        """The window's per-step label ranges, stacked (one kernel) and copied with everything else;
        judged on the host (no tensor is built from host values: that copy would sync on CUDA)."""
        if not self._seen:
            return {}
        steps, classes, los, his = zip(*self._seen)
        self._seen = []
        self._window = (steps, classes)
        return {"range": torch.stack([stack_scalars(los, torch.long), stack_scalars(his, torch.long)], dim=1)}

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        steps, classes = self._window
        lo, hi = values["range"].reshape(len(steps), 2).T
        bad = (hi >= np.asarray(classes)) | (lo < 0)
        record.scalars["diag/data/label_first_bad_step"] = float(steps[int(np.argmax(bad))]) if bad.any() else -1.0
        record.scalars["diag/data/label_bad_steps"] = float(bad.sum())
        record.scalars["diag/data/label_min"] = float(lo.min())
        record.scalars["diag/data/label_max"] = float(hi.max())
        record.scalars["diag/data/num_classes"] = float(self._classes)

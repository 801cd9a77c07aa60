"""``data_repeat``: the training batch that does not change (``next(iter(loader))`` inside the loop).

Fed by the ``batch=`` passed to ``Diagnostics.step``. Emits at every logging step:
  ``diag/data/repeat_streak``: the longest run, in this window (continued from the window before), of
  consecutive steps whose batch had the same contents as the step before while being a new tensor (0: none);
  ``diag/data/repeat_first_step``: the first step that batch was seen at (-1: none);
  ``diag/data/repeat_share``, ``diag/data/repeat_judged``: of this window's steps that followed a step, how many
  (the count) and which share of them got the previous step's contents in a new tensor (each batch arriving twice:
  an ``IterableDataset`` read by several DataLoader workers that each yield the whole stream);
  ``diag/data/batch_size``: the first dimension of the last step's fingerprinted tensor.
With ``log_eval(batch=...)``, into the evaluation's record: ``diag/data/eval_train_step`` (:meth:`on_eval_batch`).
A batch that is the very same tensor object as the step before, unchanged in place, is *held* (full-batch
training: a graph, an in-memory dataset, an L-BFGS closure's data): it never counts as a repeat; nor does a view of
all of a tensor the loop keeps, taken anew each step and unchanged (a PPO update's epochs over ``rollout.obs[:n]``),
nor, on the CPU, a new tensor over all of the step before's memory (``torch.from_numpy(x_train)`` inside the loop).
What counts is a batch rebuilt every step with identical contents, as a loader restarted each step gives, or a view
of the same part of a kept tensor every step (a loop that never advances past one window of its corpus).

Cost per step: on the batch's first floating/integer tensor, a position-weighted dot product over a strided view of
at most ``samples`` (4096) evenly spaced elements and, when that view missed some, a sum (on the CPU only up to 2**20
elements): 1-2 small kernels, no batch-sized temporary, kept by reference; a host ``is`` test on the tensor. The batch's
other floating tensors (not its integer labels, ids or masks) have their weighted sums folded in (two kernels each, up
to 7): a batch repeats only when all of it does. Measured on one thread of
a busy 2-core CPU: 0.03-0.15 ms a step for a (32, 64) batch, ~0.45 ms for (64, 3, 224, 224). The window's
fingerprints are stacked and copied with everything else at the logging step and compared on the host (no per-step
sync).
"""
from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.tensors import inputs_of, iter_tensors

FULL_SUM = 1 << 20  #: on the CPU, the whole-tensor sum only up to this many elements


def first_tensor(batch: Any) -> torch.Tensor | None:
    """The model input of ``batch`` when it is a non-empty numeric tensor, else the first such tensor in it."""
    x = inputs_of(batch)
    if isinstance(x, torch.Tensor) and _usable(x):  # the common case: no walk over the batch
        return x
    return next((t for _, t in iter_tensors(batch) if _usable(t)), None)


def _usable(t: torch.Tensor) -> bool:
    return bool(t.numel()) and t.dtype != torch.bool and not t.is_complex() and t.layout == torch.strided


Fingerprint = tuple[torch.Tensor, "torch.Tensor | None"]


def stacked(parts: list[Fingerprint]) -> torch.Tensor:
    """``(k, 2)`` float64 rows ``[weighted sum, sum]`` of ``k`` fingerprints (0 where no sum was taken): a few
    kernels for the whole window, at the logging step."""
    dots = [d for d, _ in parts]
    if len({d.dtype for d in dots}) > 1:
        dots = [d.double() for d in dots]
    col = torch.stack(dots).double()
    if all(s is None for _, s in parts):
        return torch.stack([col, torch.zeros_like(col)], 1)
    sums = torch.stack([(s if s is not None else d.new_zeros(())).double() for d, s in parts])
    return torch.stack([col, sums], 1)


class DataRepeatProbe(Probe):
    """See module docstring. Args: ``samples`` elements gathered for the position-weighted sum."""

    name = "data_repeat"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, samples: int = 4096, keep: int = 1024) -> None:
        super().__init__(enabled=enabled, every=every)
        self.samples = max(1, samples)
        self._known: deque[tuple[int, tuple[int, ...], float, float]] = deque(maxlen=max(1, keep))  # judged, on the host
        self._prev: Any = None  # weakref to the previous step's tensor
        self._prev_version = -1
        self._region: tuple[int, torch.Size, tuple[int, ...]] | None = None  # a view's place in its base (on_step)
        self._memory_before: tuple[int, int, tuple[int, ...], tuple[int, ...]] | None = None  # (on_step, _memory)
        self._pin: Any = None  # the storage _memory just read
        self._pinned: Any = None  # the storage of the step before, kept alive so that its address stays its own
        self._weights: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}
        self._seen: list[tuple[int, tuple[int, ...], bool, Fingerprint]] = []  # (step, shape, held, fingerprint)
        self._window: list[tuple[int, tuple[int, ...], bool]] = []
        self._last: tuple[int, tuple[int, ...], tuple[float, float]] | None = None  # the last judged step
        self._streak, self._start = 0, -1
        self._rows = 0

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if inputs.batch is None:
            return
        t = first_tensor(inputs.batch)
        if t is None:
            return
        # held: the very tensor of the step before, unchanged; or a view of all of a tensor the loop keeps, taken anew
        # each step (a rollout's ``obs[:n]`` over a PPO update's epochs): views share their base's version counter, so
        # "unchanged" holds for both. A view of a part of it, the same part every step, is a loop that does not
        # advance through its data (one window of a corpus): a repeat
        base = t._base
        prev = self._prev() if self._prev is not None else None
        held = t._version == self._prev_version and prev is not None and (
            prev is t or base is not None and prev is base and t.numel() == base.numel()
            and (t.storage_offset(), t.shape, t.stride()) == self._region)
        # a new tensor over the very memory of the step before's, all of it (``torch.from_numpy(x_train)`` inside a
        # full-batch loop: a new wrapper of the same array each step): held. The previous storage is kept alive until
        # the next step (CPU only: one batch), so a batch rebuilt into freed memory cannot share its address
        memory = self._memory(t) if base is None and prev is not t else None
        held = held or (memory is not None and memory == self._memory_before and t._version == self._prev_version)
        self._memory_before, self._pinned = (memory, self._pin) if memory is not None else (None, None)
        try:
            self._prev = weakref.ref(t if base is None else base)
        except TypeError:
            self._prev = None
        self._region = (t.storage_offset(), t.shape, t.stride()) if base is not None else None
        self._prev_version = t._version
        self._rows = int(t.shape[0]) if t.ndim else 1
        self._seen.append((ctx.step, tuple(t.shape), held, self._of_batch(inputs.batch, t)))

    def _of_batch(self, batch: Any, t: torch.Tensor) -> Fingerprint:
        """The fingerprint of ``t`` (the model input) with the weighted sum of every other floating tensor of the
        batch (its top level, up to 7, on ``t``'s device) folded in: a batch repeats only when all of it does (a PINN's
        boundary points rebuilt each step beside fresh collocation points is no repeated batch). Integer parts (class
        labels, token ids, masks) come from the same loader as the input and follow it: no kernel is spent on them."""
        fp = self._fingerprint(t.detach() if t.requires_grad else t)
        parts = batch if type(batch) in (tuple, list) else batch.values() if isinstance(batch, Mapping) else ()
        dot, k = fp[0], 2
        for u in parts:
            if type(u) is torch.Tensor and u is not t and u.is_floating_point() and k < 9 and u.device == t.device \
                    and _usable(u):
                d = self._fingerprint(u.detach() if u.requires_grad else u)[0]
                dot = torch.add(dot, d if d.dtype == dot.dtype else d.to(dot.dtype), alpha=k)
                k += 1
        return (dot, fp[1]) if k > 2 else fp

    def _memory(self, t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]] | None:
        """Where a CPU tensor that spans all of its storage lies (address, offset, shape, strides); its storage is
        kept in ``_pin`` for the next step to compare against. None on other devices (a device batch is not kept
        alive past its step) or for a tensor over a part of its storage."""
        if t.device.type != "cpu":
            return None
        storage = t.untyped_storage()
        if t.numel() * t.element_size() != storage.nbytes():
            return None
        self._pin = storage
        return storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()

    def _fingerprint(self, t: torch.Tensor) -> Fingerprint:
        """``(sum_i w_i x_i, sum)``: the position-weighted sum of at most ``samples`` evenly spaced elements (a
        strided view, no copy for a float32/float64 batch) and the sum of every element, None when the weighted
        sum saw every element already (a batch of at most ``samples`` values: one kernel a step) or, on the CPU,
        past ``FULL_SUM`` elements (a float sum of a large image batch costs milliseconds there); on the device."""
        flat = t.reshape(-1)
        n = flat.numel()
        picked = flat if n <= self.samples else flat[:: n // self.samples][: self.samples]  # no view op when small
        dtype = flat.dtype if flat.dtype in (torch.float32, torch.float64) else torch.float32
        key = (picked.numel(), dtype, flat.device)
        w = self._weights.get(key)
        if w is None:
            w = self._weights[key] = torch.arange(1, picked.numel() + 1, dtype=dtype, device=flat.device)
            if len(self._weights) > 64:  # variable-length batches: keep the cache small
                self._weights.pop(next(iter(self._weights)))
        dot = torch.dot(picked if picked.dtype == dtype else picked.to(dtype), w)
        if picked.numel() == n or (flat.device.type == "cpu" and n > FULL_SUM):
            return dot, None
        return dot, flat.sum().to(dtype)

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        if not self._seen:
            self._window = []
            return {}
        self._window = [(s, shape, held) for s, shape, held, _ in self._seen]
        out = {"fp": stacked([fp for *_, fp in self._seen])}
        self._seen = []
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        fps = values.get("fp")
        best, best_start = 0, -1
        judged = repeats = 0
        if fps is not None and self._window:
            fps = fps.reshape(len(self._window), 2)
            for (step, shape, held), fp in zip(self._window, fps.tolist()):
                last = self._last
                same = (last is not None and last[0] == step - 1 and last[1] == shape and last[2] == (fp[0], fp[1])
                        and not held)
                if last is not None and last[0] == step - 1 and not held:
                    judged += 1
                    repeats += same
                if same:
                    if self._streak == 0:
                        self._start = step - 1
                    self._streak += 1
                else:
                    self._streak = 0
                if self._streak > best:
                    best, best_start = self._streak, self._start
                self._last = (step, shape, (fp[0], fp[1]))
                self._known.append((step, shape, fp[0], fp[1]))
        record.scalars["diag/data/repeat_streak"] = float(best)
        record.scalars["diag/data/repeat_first_step"] = float(best_start)
        if judged:
            record.scalars["diag/data/repeat_share"] = repeats / judged
            record.scalars["diag/data/repeat_judged"] = float(judged)
        if self._rows:
            record.scalars["diag/data/batch_size"] = float(self._rows)

    def on_eval_batch(self, ctx: ProbeContext, batch: Any, record: Record) -> None:
        """``log_eval(batch=...)``: emits ``diag/data/eval_train_step`` into the evaluation's record, the latest of the
        last ``keep`` (1024) training steps whose batch had the same shape and fingerprint as the evaluation batch
        (-1: none, or the training data never changed: full-batch training evaluated on its own inputs under another
        mask). Cost: the fingerprint of the evaluation batch and one host read of it and of the window's pending
        training fingerprints (``log_eval`` reads its values back anyway)."""
        t = first_tensor(batch)
        if t is None:
            return
        fp = stacked([self._of_batch(batch, t)]).tolist()[0]
        known = list(self._known)
        if self._seen:  # this window's training batches, not yet copied with the logging step
            pending = stacked([f for *_, f in self._seen]).tolist()
            known += [(s, shape, a, b) for (s, shape, _, _), (a, b) in zip(self._seen, pending)]
        shape = tuple(t.shape)
        hits = [s for s, sh, a, b in known if sh == shape and a == fp[0] and b == fp[1]]
        varied = len({(sh, a, b) for _, sh, a, b in known}) > 1
        record.scalars["diag/data/eval_train_step"] = float(max(hits)) if hits and varied else -1.0

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self._streak, "start": self._start}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streak, self._start = int(state.get("streak", 0)), int(state.get("start", -1))

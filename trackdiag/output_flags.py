"""Which module's output went non-finite in a *real* training step: per-module flags kept on the device.

A replay (:mod:`trackdiag.replay`) finds the module that makes a NaN when the fault reproduces. Some
do not: a fault that happens once (hardware, a race, a transient condition), a model whose
``forward`` trackdiag cannot call (a LightningModule without one), a script that died before a
replay could run. :class:`OutputFlags` watches the forwards as they happen instead: after the
forward of every module of the session's models (training mode, grad enabled, eager) its floating
output, and its input when that is not one of the last outputs recorded, is *held* (a reference,
``detach()``-ed when it is part of the graph) until the step ends (on the CPU only outputs of at most
``HELD_NUMEL`` values: a larger one is summed at once). Then each becomes one fp32 sum (NaN and
Inf propagate, so the flag is non-finite exactly when the tensor held a NaN/Inf; a finite sum
overflows only past 3e38): one multi-tensor kernel on CUDA, a sum per tensor on the CPU (the CPU's
multi-tensor norm is a per-tensor loop, 3-15x slower than a sum on large tensors) -- **unless the step is known
healthy**: when the NaN replay's ``mode=step`` has read every gradient of the step finite (its one host
sync per step, :meth:`judged`) and the step is not a logging step, the held outputs are let go and no
flag is computed. Past ``max_mb`` MB or ``chunk`` tensors held, the waiting ones are summed at once.
The flags of the last ``ring`` steps stay on the device as one tensor per step; they are read back only
when a non-finite alert or a crash asks which module was first (completion order: the innermost module
that completed first, and whether its input was finite), and at logging steps with the session's one
host copy, to learn the modules whose output is non-finite on healthy steps too (``-inf`` attention
masks): those are never blamed. An output changed in place after its module returned (``relu_``,
``x += y``) is read as it is at the step's end (NaN stays NaN under such ops; ``-inf`` clamped to 0 does not).

Cost per module call: a few Python operations (~3-5 us on the CPU) and no kernel; per judged healthy
step nothing more; per other step one sum per held tensor (CPU: ~3 us plus a read of the output, ~50 us
per million values on one core; CUDA: one kernel) and one ``stack``. No host read. Measured
(benchmarks/flight.py, docs/crash-and-replay.md). Memory: at most ``max_mb`` of module outputs held
past their time (until the step ends); 4 bytes per module call for ``ring`` steps.
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any

import torch
from torch import nn

from trackdiag.context import ProbeContext
from trackdiag.forward_watch import FORWARD
from trackdiag.layers import ROOT

Key = tuple[str, str]  # (component, module name)
#: CPU outputs of more values are summed at once, in cache, not held: keeping a large activation alive past the
#: backward pass costs the allocator more than its sum (a CNN at ``extreme``: 1.10 -> 1.20 of the bare step)
HELD_NUMEL = 1 << 16


class _Step:
    """The flags of one step: per module call (completion order) its key and the positions of its
    output's and its input's flag in ``flags`` (-1: input not recorded)."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.outs: list[int] = []
        self.ins: list[int] = []
        self.vals: list[torch.Tensor | None] = []  # 0-d sums (None: held, waiting for the flush)
        self.flags: torch.Tensor | None = None      # ``vals`` stacked at the end of the step (None: judged healthy)
        self.finite: bool | None = None  # every gradient judged so far this step was finite (None: not judged)
        self.judged = 0                  # module calls recorded before the last judgement


class OutputFlags:
    """See module docstring."""

    def __init__(self, ctx: ProbeContext, ring: int, chunk: int = 4096, max_mb: float = 64.0) -> None:
        self.ctx = ctx
        self.ring, self.chunk, self.max_bytes = max(ring, 1), max(chunk, 1), int(max_mb * 2**20)
        self._names: dict[int, Key] = {}
        self._roots: set[int] = set()
        for comp in ctx.components:
            if comp.model is None:
                continue
            for name, m in comp.model.named_modules():
                self._names.setdefault(id(m), (comp.name, name or ROOT))
            self._roots.add(id(comp.model))
            if comp.outer is not None:
                self._roots.add(id(comp.outer))
        self._now = _Step()  # the running step
        self._waiting: list[tuple[int, torch.Tensor]] = []  # (position, tensor) held until the flush
        self._bytes = 0
        self._last: torch.Tensor | None = None  # the output recorded last (a container hands it on)
        self._last_at = -1
        self._recent: list[tuple[torch.Tensor, int]] = []  # the last few outputs: a module's input is often one
        self._steps: collections.OrderedDict[int, _Step] = collections.OrderedDict()
        self.habitual: set[Key] = set()  # non-finite on healthy steps too: never blamed
        self._stop: Any = None

    def start(self) -> None:
        if self._stop is None:
            self._stop = FORWARD.watch_all(self._seen)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None
        self._now, self._waiting, self._last, self._recent = _Step(), [], None, []
        self._steps.clear()

    def _seen(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Every eager module forward (hot path: host work only; the sums wait for :meth:`flush`)."""
        key = self._names.get(id(module))
        if key is None or not module.training or not torch.is_grad_enabled():
            return
        t = output
        if type(t) is not torch.Tensor:
            t = output[0] if isinstance(output, (tuple, list)) and output else None
        if not isinstance(t, torch.Tensor) or t is self._last or not t.is_floating_point():
            if id(module) in self._roots:  # a container handing on its last child's output, or no tensor
                self._last, self._recent = None, []
            return
        t0 = time.perf_counter()
        x = args[0] if args else None
        now = self._now
        if type(x) is not torch.Tensor or not x.is_floating_point():
            now.ins.append(-1)
        elif x is self._last:  # the usual case: the output of the module that ran just before
            now.ins.append(self._last_at)
        else:
            at = -1
            for r, i in self._recent:
                if r is x:
                    at = i
                    break
            now.ins.append(at if at >= 0 else self._add(x))
        at = self._last_at = self._add(t)
        self._last = t
        recent = self._recent
        recent.append((t, at))
        if len(recent) > 4:
            del recent[0]
        now.outs.append(at)
        now.keys.append(key)
        if id(module) in self._roots:
            self._last, self._recent = None, []  # the model's outputs: not kept past its forward
        if len(self._waiting) >= self.chunk or self._bytes >= self.max_bytes:
            self.flush()
        self.ctx.hook_seconds += time.perf_counter() - t0  # inside the user's forward: the session's clock misses it

    @staticmethod
    def batched(t: torch.Tensor) -> bool:
        """Whether the held tensors (led by ``t``) take one multi-tensor kernel (CUDA) or a sum each (CPU)."""
        return t.is_cuda

    def _add(self, t: torch.Tensor) -> int:
        """The position of ``t``'s flag in the running step (set by the next :meth:`flush`)."""
        vals = self._now.vals
        if t.layout is not torch.strided:
            vals.append(torch.zeros((), dtype=torch.float32, device=t.device))
        elif t.numel() <= HELD_NUMEL or self.batched(t):  # held, not read: a healthy judged step never reads it
            self._waiting.append((len(vals), t.detach() if t.requires_grad else t))
            self._bytes += t.numel() * t.element_size()
            vals.append(None)
        else:  # a large CPU output: summed now, while it is in cache (held, it would outlive the backward pass)
            torch._C._set_grad_enabled(False)  # no part of the user's graph (grad mode was on: checked by the caller)
            try:
                vals.append(t.sum(dtype=torch.float32))
            finally:
                torch._C._set_grad_enabled(True)
        return len(vals) - 1

    @torch.no_grad()
    def flush(self) -> None:
        """The held tensors into flags: one multi-tensor kernel on CUDA (per device and dtype), a sum each on the CPU."""
        if not self._waiting:
            return
        waiting, self._waiting, self._bytes = self._waiting, [], 0
        vals = self._now.vals
        tensors = [t for _, t in waiting]
        if self.batched(tensors[0]):
            try:  # one device (the usual case): one call; the kernel takes mixed dtypes
                sums = torch._foreach_norm(tensors, 1, dtype=torch.float32)  # L1: one fused pass
            except (RuntimeError, NotImplementedError):  # several devices
                sums = [torch.linalg.vector_norm(t, 1, dtype=torch.float32) for t in tensors]
        else:  # vectorised, multi-threaded; the CPU's multi-tensor norm is a slow per-tensor loop
            sums = [t.sum(dtype=torch.float32) for t in tensors]
        for (i, _), v in zip(waiting, sums):
            vals[i] = v

    def judged(self, finite: bool) -> None:
        """The NaN replay (``mode=step``) read this pass's gradients: finite or not. A step whose every
        judgement was finite, covering every output recorded, needs no flags (unless it is a logging step)."""
        now = self._now
        now.finite = finite and now.finite is not False
        now.judged = len(now.keys)

    def end_step(self, step: int, due: bool = True) -> None:
        """``Diagnostics.step``: the running step's flags join the ring (one ``stack``), unless the step was
        judged healthy and is not ``due`` (a logging step): then its held outputs are let go unread."""
        now = self._now
        if not due and now.finite and now.judged == len(now.keys):
            self._waiting, self._bytes, now.vals = [], 0, []
        else:
            self.flush()
            if now.keys:
                now.flags = _stacked(now.vals)
                now.vals = []
        self._now, self._last, self._recent = _Step(), None, []
        if now.keys:
            self._steps[step] = now
            while len(self._steps) > self.ring:
                self._steps.popitem(last=False)

    def _entry(self, step: int, running: bool) -> _Step | None:
        if running:
            self.flush()
            if self._now.keys:
                self._now.flags = _stacked(self._now.vals)
                return self._now
        return self._steps.get(step)

    def device_flags(self, step: int) -> torch.Tensor | None:
        """The flags of ``step`` as one device tensor (for the logging step's host copy), or None."""
        entry = self._steps.get(step)
        return entry.flags if entry is not None else None

    def learn(self, step: int, values: Any) -> None:
        """A healthy logging step's flags (host values): modules non-finite there are habitual."""
        entry = self._steps.get(step)
        if entry is None or entry.flags is None or entry.flags.numel() != len(values):
            return
        self.habitual.update(k for k, i in zip(entry.keys, entry.outs) if not math.isfinite(float(values[i])))

    def first_bad(self, step: int, running: bool = False) -> tuple[Key, bool | None, int, int] | None:
        """``((component, module), input finite, calls, flagged)`` for the first module call of ``step``
        whose output held a NaN/Inf (habitual modules left out): whether its input was finite (None:
        not recorded), the number of module calls recorded and how many were non-finite; None when
        every output was finite or nothing was recorded. One host read (alert and crash paths only).
        ``running``: the step in progress (not yet ended by ``step()``)."""
        entry = self._entry(step, running)
        if entry is None or entry.flags is None:
            return None
        values = entry.flags.float().cpu().tolist()
        bad = [(k, i) for k, o, i in zip(entry.keys, entry.outs, entry.ins)
               if not math.isfinite(values[o]) and k not in self.habitual]
        if not bad:
            return None
        key, i = bad[0]
        return key, (math.isfinite(values[i]) if i >= 0 else None), len(entry.keys), len(bad)

    def recorded(self, step: int, running: bool = False) -> int:
        """How many module calls of ``step`` were recorded (0: none: compiled, or no eager forward)."""
        entry = self._now if running else self._steps.get(step)
        return len(entry.keys) if entry is not None else 0


def _stacked(vals: list[torch.Tensor | None]) -> torch.Tensor:
    """The step's flags as one tensor (on the first value's device; every value is set after a flush)."""
    got = [v for v in vals if v is not None]
    try:
        return torch.stack(got)  # one device: the usual case
    except RuntimeError:
        device = got[0].device
        return torch.stack([v if v.device == device else v.to(device) for v in got])

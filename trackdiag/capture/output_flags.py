"""Which module's output went non-finite in a *real* training step: per-module flags kept on the device.

A replay (:mod:`trackdiag.forensics.replay`) finds the module that makes a NaN when the fault reproduces. Some
do not: a fault that happens once (hardware, a race, a transient condition), a model whose
``forward`` trackdiag cannot call (a LightningModule without one), a script that died before a
replay could run. :class:`OutputFlags` watches the forwards as they happen instead: after the
forward of every module of the session's models (training mode, grad enabled, eager; seen through each
module's own call slot, :mod:`trackdiag.capture.root_call`, so no module of the process leaves PyTorch's fast
call path) its floating output, and its input when that is not the output recorded just before, is
*held*: one list append of the tensors as they are, until the step ends (on the CPU only outputs of at
most ``HELD_NUMEL`` values: a larger one is summed at once). Then, **unless the step is known healthy**,
each call gets its positions (a tensor seen twice in the step, an input that is an earlier module's
output, keeps one), each held tensor is detached and becomes one fp32 sum (NaN and Inf propagate, so
the flag is non-finite exactly when the tensor held a NaN/Inf; a finite sum overflows only past 3e38):
one multi-tensor kernel on CUDA, a sum per tensor on the CPU (the CPU's multi-tensor norm is a
per-tensor loop, 3-15x slower than a sum on large tensors). Known healthy: the NaN replay's
``mode=step`` has read every gradient of the step finite (its one host sync per step, :meth:`judged`)
and the step is not one that learns habitual modules (``due``: some logging steps, see
:mod:`trackdiag.probes.flight`); then the held calls are let go unread. Past ``max_mb`` MB or
``chunk`` calls held, the waiting ones are placed and summed at once.
The flags of the last ``ring`` steps stay on the device as one tensor per step; they are read back only
when a non-finite alert or a crash asks which module was first (completion order: the innermost module
that completed first, and whether its input was finite), and at the logging steps that learn with the session's one
host copy, to learn the modules whose output is non-finite on healthy steps too (``-inf`` attention
masks): those are never blamed. An output changed in place after its module returned (``relu_``,
``x += y``) is read as it is at the step's end (NaN stays NaN under such ops; ``-inf`` clamped to 0 does not).

Cost per module call: its call slot and one append (~1-2 us on the CPU) and no kernel; per judged
healthy step nothing more; per other step the placing (a few Python operations per call), one sum per
held tensor (CPU: ~3 us plus a read of the output, ~50 us per million values on one core; CUDA: one
kernel) and one ``stack``. No host read. Measured (benchmarks/flight.py, docs/crash-and-replay.md).
Memory: until the step ends, the held outputs (at most ``max_mb``) and their autograd graph (after
``backward()`` only its nodes; a training-mode forward never backpropagated keeps its saved activations
until then, as the NaN replay's capture does); 4 bytes per module call for ``ring`` steps.
"""
from __future__ import annotations

import collections
import math
import time
from typing import Any

import torch
from torch import nn

from trackdiag.capture.context import ProbeContext
from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.layers import ROOT
from trackdiag.util.norms import fp32_norm

Key = tuple[str, str]  # (component, module name)
#: CPU outputs of more values are summed at once, in cache, not held: keeping a large activation alive past the
#: backward pass costs the allocator more than its sum (a CNN at ``extreme``: 1.10 -> 1.20 of the bare step)
HELD_NUMEL = 1 << 16
_grad_enabled = torch.is_grad_enabled


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
        self.calls = 0                   # module calls recorded (placed in ``keys`` or let go unread)


#: a call's input was the output recorded just before it (the usual chain of modules)
_PREV = object()


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
        # the running step's calls as recorded (key, output, input, output already summed), placed lazily
        self._calls: list[tuple[Key, torch.Tensor, Any, bool]] = []
        self._waiting: list[tuple[int, torch.Tensor]] = []  # (position, tensor) held until the flush
        self._placed: dict[int, tuple[int, torch.Tensor]] = {}  # id(tensor) -> (position, tensor), until the flush
        self._prev_at = -1  # position of the output placed last
        self._bytes = 0
        self._last: torch.Tensor | None = None  # the output recorded last (a container hands it on)
        self._steps: collections.OrderedDict[int, _Step] = collections.OrderedDict()
        self.habitual: set[Key] = set()  # non-finite on healthy steps too: never blamed
        self._stops: list[Any] | None = None  # one stopper per watched module, while started

    def start(self) -> None:
        """Watch the forward of every module of the session's models through its own call slot (the
        global forward hook only for a module whose slot is taken: ``module.compile()``): a global hook
        would put every module call of the process on PyTorch's slower path."""
        if self._stops is None:
            modules = {id(m): m for comp in self.ctx.components if comp.model is not None
                       for m in comp.model.modules() if id(m) in self._names}
            self._stops = [FORWARD.watch(m, post=self._watcher(self._names[i], i in self._roots), root=True)
                           for i, m in modules.items()]

    def stop(self) -> None:
        for stop in self._stops or ():
            stop()
        self._stops = None
        self._reset()
        self._steps.clear()

    def _reset(self) -> None:
        """A new running step: nothing held."""
        self._now, self._calls, self._waiting, self._placed, self._last = _Step(), [], [], {}, None
        self._prev_at, self._bytes = -1, 0

    def _watcher(self, key: Key, root: bool) -> Any:
        """The forward watcher of one module (its key and whether it is a model's root bound in: the hot path
        looks nothing up): one append of the output and the input as they are; positions, detaching and sums
        wait for :meth:`flush`, which a step judged healthy never needs."""
        clock, ctx = time.perf_counter, self.ctx

        def seen(module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> None:
            if not module.training or not _grad_enabled():
                return
            t = output
            if type(t) is not torch.Tensor:
                t = output[0] if isinstance(output, (tuple, list)) and output else None
                if not isinstance(t, torch.Tensor):
                    t = None
            last = self._last
            if t is None or t is last or not t.is_floating_point():
                if root:  # a container handing on its last child's output, or no tensor
                    self._last = None
                return
            t0 = clock()
            x = args[0] if args else None
            if type(x) is not torch.Tensor:
                x = None
            elif x is last:
                x = _PREV
            elif not x.is_floating_point():
                x = None
            elif x.numel() > HELD_NUMEL and x.layout is torch.strided and not self.batched(x):
                x = (self._sum_now(x),)  # a large CPU input: summed now, while it is in cache
            n = t.numel()
            if n > HELD_NUMEL and t.layout is torch.strided and not self.batched(t):
                self._calls.append((key, self._sum_now(t), x, True))
            else:
                self._calls.append((key, t, x, False))
                self._bytes += n * t.element_size()
            self._last = None if root else t  # the model's outputs: not kept past its forward
            if len(self._calls) >= self.chunk or self._bytes >= self.max_bytes:
                self.flush()
            ctx.hook_seconds += clock() - t0  # inside the user's forward: the session's clock misses it
        return seen

    @staticmethod
    def batched(t: torch.Tensor) -> bool:
        """Whether the held tensors (led by ``t``) take one multi-tensor kernel (CUDA) or a sum each (CPU)."""
        return t.is_cuda

    @staticmethod
    def _sum_now(t: torch.Tensor) -> torch.Tensor:
        """A large CPU tensor's flag, taken at once (held, it would outlive the backward pass: a CNN at
        ``extreme`` went 1.10 -> 1.20 of the bare step); no part of the user's graph."""
        with torch.no_grad():  # a context manager: a KeyboardInterrupt cannot leave grad mode off
            return t.sum(dtype=torch.float32)

    def _hold(self, t: torch.Tensor) -> int:
        """The position of ``t``'s flag in the running step (set by the next :meth:`flush`)."""
        vals = self._now.vals
        at = len(vals)
        if t.layout is not torch.strided:
            vals.append(torch.zeros((), dtype=torch.float32, device=t.device))
        else:  # held, not read: a healthy judged step never reads it
            self._waiting.append((at, t.detach() if t.requires_grad else t))
            vals.append(None)
        self._placed[id(t)] = (at, t)
        return at

    def _place(self) -> None:
        """The recorded calls into the running step's keys and flag positions: a tensor seen before in the
        step (an input that is an earlier module's output) keeps its one position."""
        calls, self._calls = self._calls, []
        now, placed = self._now, self._placed
        vals = now.vals
        prev = self._prev_at
        for key, t, x, big in calls:
            if x is None:
                i = -1
            elif x is _PREV:
                i = prev
            elif type(x) is tuple:  # summed when seen
                i = len(vals)
                vals.append(x[0])
            else:
                got = placed.get(id(x))
                i = got[0] if got is not None else self._hold(x)
            if big:
                prev = len(vals)
                vals.append(t)
            else:
                got = placed.get(id(t))
                prev = got[0] if got is not None else self._hold(t)
            now.ins.append(i)
            now.outs.append(prev)
            now.keys.append(key)
        self._prev_at = prev
        now.calls += len(calls)

    @torch.no_grad()
    def flush(self) -> None:
        """The recorded calls placed, the held tensors into flags: one multi-tensor kernel on CUDA (per
        device and dtype), a sum each on the CPU."""
        self._place()
        if len(self._placed) > 4:  # the last few stay known (a later input is often one of them); the rest let go
            self._placed = dict(list(self._placed.items())[-4:])
        if not self._waiting:
            self._bytes = 0
            return
        waiting, self._waiting, self._bytes = self._waiting, [], 0
        vals = self._now.vals
        tensors = [t for _, t in waiting]
        if self.batched(tensors[0]):
            try:  # one device (the usual case): one call; the kernel takes mixed dtypes
                sums = torch._foreach_norm(tensors, 1, dtype=torch.float32)  # L1: one fused pass
            except (RuntimeError, NotImplementedError):  # several devices, or fp64 outputs (no fp32 accumulation of fp64)
                sums = [fp32_norm(t, 1) for t in tensors]
        else:  # vectorised, multi-threaded; the CPU's multi-tensor norm is a slow per-tensor loop
            sums = [t.sum(dtype=torch.float32) for t in tensors]
        for (i, _), v in zip(waiting, sums):
            vals[i] = v

    def judged(self, finite: bool) -> None:
        """The NaN replay (``mode=step``) read this pass's gradients: finite or not. A step whose every
        judgement was finite, covering every output recorded, needs no flags (unless it is ``due``: a learning step)."""
        now = self._now
        now.finite = finite and now.finite is not False
        now.judged = now.calls + len(self._calls)

    def end_step(self, step: int, due: bool = True) -> None:
        """``Diagnostics.step``: the running step's flags join the ring (one ``stack``), unless the step was
        judged healthy and is not ``due`` (a logging step that learns habitual modules): then its held outputs are let go unread."""
        now = self._now
        if not due and now.finite and now.judged == now.calls + len(self._calls):
            now.calls += len(self._calls)  # let go unread
            now.vals = []
        else:
            self.flush()
            if now.keys:
                now.flags = _stacked(now.vals)
                now.vals = []
        self._reset()
        if now.calls:
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
        n = len(values)  # (an entry a KeyboardInterrupt cut short may name more positions than it holds)
        self.habitual.update(k for k, i in zip(entry.keys, entry.outs) if i < n and not math.isfinite(float(values[i])))

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
        n = len(values)  # (see learn)
        bad = [(k, i) for k, o, i in zip(entry.keys, entry.outs, entry.ins)
               if o < n and not math.isfinite(values[o]) and k not in self.habitual]
        if not bad:
            return None
        key, i = bad[0]
        return key, (math.isfinite(values[i]) if 0 <= i < n else None), len(entry.keys), len(bad)

    def recorded(self, step: int, running: bool = False) -> int:
        """How many module calls of ``step`` were recorded (0: none: compiled, or no eager forward)."""
        if running:
            return self._now.calls + len(self._calls)
        entry = self._steps.get(step)
        return entry.calls if entry is not None else 0


def _stacked(vals: list[torch.Tensor | None]) -> torch.Tensor:
    """The step's flags as one tensor (on the first value's device; every value is set after a flush)."""
    got = [v for v in vals if v is not None]
    try:
        return torch.stack(got)  # one device: the usual case
    except RuntimeError:
        device = got[0].device
        return torch.stack([v if v.device == device else v.to(device) for v in got])

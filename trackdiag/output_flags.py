"""Which module's output went non-finite in a *real* training step: per-module flags kept on the device.

A replay (:mod:`trackdiag.replay`) finds the module that makes a NaN when the fault reproduces. Some
do not: a fault that happens once (hardware, a race, a transient condition), a model whose
``forward`` trackdiag cannot call (a LightningModule without one), a script that died before a
replay could run. :class:`OutputFlags` watches the forwards as they happen instead: after the
forward of every module of the session's models (training mode, grad enabled, eager), a reference to
its floating output (and to its input when that is not an output already kept) is kept; at the end of
the root model's forward (or every ``chunk`` outputs, or at ``Diagnostics.step``) the kept tensors
become one fp32 sum each (NaN and Inf propagate: the flag is non-finite exactly when the tensor held a
NaN/Inf; on CUDA one multi-tensor kernel) and the references are dropped. The flags of the last ``ring`` steps stay on the device; they are read back
only when a non-finite alert or a crash asks which module was first (execution order: the innermost
module that completed first), and at logging steps with the session's one host copy, to learn the
modules whose output is non-finite on healthy steps too (``-inf`` attention masks): those are never
blamed.

Cost per module call: one Python call and a list append on the training thread (~1-2 us on CPU);
per root forward: the sums and one ``stack`` (device work, no host read). On the CPU the sums read
every module output once more (~50 us per million values on one core: 3-15 % of a step of a small
conv net or transformer, see docs/crash-and-replay.md); on CUDA one kernel per forward. Memory: the
outputs of one root forward (at most ``chunk``) are kept until its end; the flags of ``ring`` steps
(4 bytes per module call).
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


def _sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 value per tensor that is non-finite exactly when the tensor holds a NaN/Inf: its sum
    (NaN and Inf propagate; a finite sum overflows only past 3e38). On CUDA one multi-tensor kernel
    (``_foreach_norm``, L1 in fp32); on the CPU one vectorised ``sum`` per tensor (the CPU's
    ``_foreach_norm`` is 10-200x slower per element). Device ops only."""
    if tensors[0].is_cuda and len({(t.device, t.dtype) for t in tensors}) == 1:
        return torch.stack(torch._foreach_norm(tensors, 1, dtype=torch.float32))
    return torch.stack([t.sum(dtype=torch.float32) for t in tensors])


class _Step:
    """The flags of one step: per module call (completion order) its key and the positions of its
    output's and its input's flag in the concatenated chunks (-1: input not recorded)."""

    def __init__(self) -> None:
        self.keys: list[Key] = []
        self.outs: list[int] = []
        self.ins: list[int] = []
        self.chunks: list[torch.Tensor] = []
        self.size = 0


class OutputFlags:
    """See module docstring."""

    def __init__(self, ctx: ProbeContext, ring: int, chunk: int = 64) -> None:
        self.ctx = ctx
        self.ring, self.chunk = max(ring, 1), max(chunk, 1)
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
        self._pending: list[torch.Tensor] = []
        self._pending_in: list[torch.Tensor | None] = []
        self._pending_keys: list[Key] = []
        self._now = _Step()  # the running step
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
        self._pending, self._pending_in, self._pending_keys = [], [], []
        self._steps.clear()

    def _seen(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Every eager module forward (hot path: host work only)."""
        key = self._names.get(id(module))
        if key is None or not module.training or not torch.is_grad_enabled():
            return
        t = output
        if type(t) is not torch.Tensor:
            t = output[0] if isinstance(output, (tuple, list)) and output else None
            if not isinstance(t, torch.Tensor):
                return
        if not t.is_floating_point():
            return
        pending = self._pending
        if pending and pending[-1] is t:  # a container handing on its last child's output
            return
        t0 = time.perf_counter()
        x = args[0] if args else None
        pending.append(t)
        self._pending_in.append(x if type(x) is torch.Tensor and x.is_floating_point() else None)
        self._pending_keys.append(key)
        if len(pending) >= self.chunk or id(module) in self._roots:
            self.flush()
        self.ctx.hook_seconds += time.perf_counter() - t0  # inside the user's forward: the session's clock misses it

    @torch.no_grad()
    def flush(self) -> None:
        """The kept outputs (and the inputs that are not one of them) into flags: one
        ``_foreach_norm`` and one ``stack`` (device ops)."""
        if not self._pending:
            return
        tensors, inputs, keys = self._pending, self._pending_in, self._pending_keys
        self._pending, self._pending_in, self._pending_keys = [], [], []
        where = {id(t): i for i, t in enumerate(tensors)}
        ins = []
        for x in inputs:  # an input that is a recorded output (a Sequential's chain) costs nothing more
            if x is not None and id(x) not in where:
                where[id(x)] = len(tensors)
                tensors.append(x)
            ins.append(where[id(x)] if x is not None else -1)
        try:
            flags = _sums(tensors)
        except (RuntimeError, TypeError):  # odd tensors (sparse, meta, several devices): one at a time, on the host
            flags = torch.stack([t.detach().sum(dtype=torch.float32).cpu() if t.numel() and t.layout is torch.strided
                                 else torch.zeros((), dtype=torch.float32) for t in tensors])
        now = self._now
        now.keys.extend(keys)
        now.outs.extend(now.size + j for j in range(len(keys)))
        now.ins.extend(now.size + i if i >= 0 else -1 for i in ins)
        now.chunks.append(flags)
        now.size += len(tensors)

    def end_step(self, step: int) -> None:
        """``Diagnostics.step``: the running step's flags join the ring."""
        self.flush()
        if self._now.keys:
            self._steps[step] = self._now
            while len(self._steps) > self.ring:
                self._steps.popitem(last=False)
        self._now = _Step()

    def _entry(self, step: int, running: bool) -> _Step | None:
        if running:
            self.flush()
            if self._now.keys:
                return self._now
        return self._steps.get(step)

    def device_flags(self, step: int) -> torch.Tensor | None:
        """The flags of ``step`` as one device tensor (for the logging step's host copy), or None."""
        entry = self._steps.get(step)
        return torch.cat(entry.chunks) if entry else None

    def learn(self, step: int, values: Any) -> None:
        """A healthy logging step's flags (host values): modules non-finite there are habitual."""
        entry = self._steps.get(step)
        if entry is None or entry.size != len(values):
            return
        self.habitual.update(k for k, i in zip(entry.keys, entry.outs) if not math.isfinite(float(values[i])))

    def first_bad(self, step: int, running: bool = False) -> tuple[Key, bool | None, int, int] | None:
        """``((component, module), input finite, calls, flagged)`` for the first module call of ``step``
        whose output held a NaN/Inf (habitual modules left out): whether its input was finite (None:
        not recorded), the number of module calls recorded and how many were non-finite; None when
        every output was finite or nothing was recorded. One host read (alert and crash paths only).
        ``running``: the step in progress (not yet ended by ``step()``)."""
        entry = self._entry(step, running)
        if entry is None:
            return None
        values = torch.cat([f.float().cpu() for f in entry.chunks]).tolist()
        bad = [(k, i) for k, o, i in zip(entry.keys, entry.outs, entry.ins)
               if not math.isfinite(values[o]) and k not in self.habitual]
        if not bad:
            return None
        (key, i) = bad[0]
        return key, (math.isfinite(values[i]) if i >= 0 else None), len(entry.keys), len(bad)

    def recorded(self, step: int, running: bool = False) -> int:
        """How many module calls of ``step`` were recorded (0: none: compiled, or no eager forward)."""
        if running:
            return len(self._now.keys) + len(self._pending_keys)
        entry = self._steps.get(step)
        return len(entry.keys) if entry else 0

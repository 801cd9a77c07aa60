"""A bounded copy of a model's parameters from before a fault, so a NaN can be replayed on finite weights.

Why: without a host read per step, a NaN made in step k's forward is noticed at the next logging
step, after the optimizer has written NaN into every weight; a replay on those weights blames the
first layer. The NaN-replay probe therefore keeps one copy of the parameters taken at each logging
step whose record was entirely finite: at most ``every`` steps older than the
fault, so a replay of the bad step's batch on it finds the module that makes the NaN whenever the
fault does not depend on those last few updates. Buffers are not copied: a training-mode forward
does not read BatchNorm's running statistics, and a fault switched on through a buffer (a mask, a
flag) must replay as it happened.

Cost: one ``_foreach_copy_`` of the parameters per logging step (the copy is allocated once), and
1x parameter memory on their device; none beyond ``max_bytes`` (the probe then says why it cannot
replay on earlier weights). Applying it for a replay costs two more copies and restores every value
bit for bit.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn


class ParamSnapshot:
    """Copies of ``model``'s parameters (see module docstring)."""

    def __init__(self, model: nn.Module, max_bytes: int) -> None:
        self.model = model
        self.max_bytes = max_bytes
        self.step: int | None = None
        self._copies: list[torch.Tensor] | None = None
        self.refused: str = ""

    def _tensors(self) -> list[torch.Tensor]:
        # callers copy under no_grad: no detach() per tensor (2.8 us each on the CPU)
        return [t for t in self.model.parameters() if t.layout is torch.strided and t.device.type != "meta"]

    @torch.no_grad()
    def take(self, step: int) -> bool:
        """Copy the current values as those of ``step`` (device work, no host read)."""
        tensors = self._tensors()
        size = sum(t.numel() * t.element_size() for t in tensors)
        if size > self.max_bytes:
            self.refused = (f"the parameters ({size / 2**20:.0f} MB) exceed probes.nan_replay.snapshot_mb "
                            f"({self.max_bytes / 2**20:.0f} MB)")
            return False
        if self._copies is None or len(self._copies) != len(tensors) or any(
                c.shape != t.shape or c.dtype != t.dtype or c.device != t.device for c, t in zip(self._copies, tensors)):
            self._copies = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(self._copies, tensors)
        self.step = step
        return True

    @contextlib.contextmanager
    def applied(self) -> Iterator[int]:
        """The snapshot's values in the model for the duration (yields its step); every current
        value is put back exactly afterwards."""
        if self._copies is None or self.step is None:
            raise RuntimeError("no snapshot taken")
        tensors = self._tensors()
        with torch.no_grad():
            saved = [t.clone() for t in tensors]
            torch._foreach_copy_(tensors, self._copies)
        try:
            yield self.step
        finally:
            with torch.no_grad():
                torch._foreach_copy_(tensors, saved)

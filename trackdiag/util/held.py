"""Batch tensors kept by reference until the logging step, so that a step's data checks cost no device op.

The data probes judge every step's batch (NaN/Inf in the inputs, labels outside the classes). Reducing each batch
at its step is one to a dozen small kernels a step, each a few microseconds of dispatch on the CPU and a launch
on a GPU; for a batch that is small and that nobody writes into afterwards, the same reductions over the whole
window at the logging step give the same values for a few kernels in all. :class:`Holder` decides, per tensor,
which way a step goes:

- kept (a :class:`Held`: the tensor and its version counter) when it is at most :data:`HOLD_TENSOR_BYTES`, the
  window keeps at most :data:`HOLD_WINDOW_BYTES`, it takes no gradient (an input being optimised, as in style
  transfer, changes every step) and its entry has not been seen overwritten;
- else reduced at its step, as before.

A loader that writes each batch into the same tensor (a CUDA-graph loop's static input, a prefetcher's fixed
buffers) changes a kept tensor's version counter before the logging step: :meth:`Held.intact` says so, the step's
values are gone, and that entry is reduced at its step from then on (:meth:`Holder.overwritten`). Host work only;
nothing here launches a kernel.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("trackdiag")

#: a batch tensor larger than this is reduced at its step (a 256x3x224x224 image batch is 150 MiB)
HOLD_TENSOR_BYTES = 1 << 20
#: at most this much batch data kept per probe and window (50 steps of a (64, 3, 32, 32) float batch: 38 MiB)
HOLD_WINDOW_BYTES = 48 << 20


@dataclass(slots=True)
class Held:
    """A step's batch tensor, kept to be reduced at the logging step."""

    tensor: torch.Tensor
    version: int

    @property
    def intact(self) -> bool:
        """Nothing wrote into the tensor since its step (its version counter is the same)."""
        return self.tensor._version == self.version


class Holder:
    """One probe's choice, per batch entry (``"batch[0]"``, ``"targets"``), between keeping and reducing now."""

    __slots__ = ("kept", "off", "probe")

    def __init__(self, probe: str) -> None:
        self.probe = probe
        self.kept = 0  # bytes kept in the window in progress
        self.off: set[str] = set()  # entries seen overwritten in place: reduced at their step

    def hold(self, entry: str, t: torch.Tensor) -> Held | None:
        """``t`` kept for the logging step, or None: reduce it now."""
        if t.requires_grad or entry in self.off:
            return None
        size = t.numel() * t.element_size()
        if size > HOLD_TENSOR_BYTES or self.kept + size > HOLD_WINDOW_BYTES:
            return None
        self.kept += size
        return Held(t, t._version)

    def window_done(self) -> None:
        """The logging step took the window's tensors."""
        self.kept = 0

    def overwritten(self, entry: str, steps: int) -> None:
        """``entry``'s kept tensors were written into before the logging step: from now on it is reduced at its step."""
        if entry not in self.off:
            self.off.add(entry)
            log.info("trackdiag: %s: %s is written in place between steps (a reused buffer): %d step(s) of this "
                     "window could not be checked; checked at each step from now on", self.probe, entry, steps)

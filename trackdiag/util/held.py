"""Batch tensors kept by reference until the logging step, so that a step's data checks cost no device op.

The label checks (``data_labels``) reduce every step's targets a dozen ways (range, padding value, single class,
targets equal to the inputs): a dozen small kernels a step, each a few microseconds of dispatch on the CPU and a
launch on a GPU. For targets that are small and that nobody writes into afterwards, the same reductions over the
window's stacked targets at the logging step give the same values for a dozen kernels in all (on one CPU thread,
50 steps of 32 labels: 0.19 ms at the logging step against 3.1 ms spread over the steps; from ~4,096 labels a step
the stacked reductions stop paying on the CPU). :class:`Holder` decides, per tensor, which way a step goes:

- kept (a :class:`Held`: the tensor and its version counter) when it has at most the holder's ``elements``, the
  window keeps at most :data:`HOLD_WINDOW_BYTES`, it takes no gradient and its entry has not been seen overwritten;
- else reduced at its step, as before.

A loader that writes each batch into the same tensor (a CUDA-graph loop's static input, a prefetcher's fixed
buffers) changes a kept tensor's version counter before the logging step: :meth:`Held.intact` says so, the step's
values are gone, and that entry is reduced at its step from then on (:meth:`Holder.overwritten`, said once in the
log). Host work only; nothing here launches a kernel.

Not used for the NaN/Inf check of the inputs (``data_finite``): it is one ``aminmax`` a step, and the CPU's
reductions of a window at once (``_foreach_norm(inf)``, ``aminmax`` along a dimension) cost more than the steps'
(10 batches of 32x3x32x32: 4.7-6.1 ms against 0.13 ms).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("trackdiag")

#: at most this much batch data kept per probe and window
HOLD_WINDOW_BYTES = 16 << 20


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

    __slots__ = ("elements", "kept", "off", "probe")

    def __init__(self, probe: str, elements: int) -> None:
        self.probe = probe
        self.elements = elements  # a larger tensor is reduced at its step
        self.kept = 0  # bytes kept in the window in progress
        self.off: set[str] = set()  # entries seen overwritten in place: reduced at their step

    def hold(self, entry: str, t: torch.Tensor) -> Held | None:
        """``t`` kept for the logging step, or None: reduce it now."""
        if t.requires_grad or entry in self.off:
            return None
        n = t.numel()
        size = n * t.element_size()
        if n > self.elements or self.kept + size > HOLD_WINDOW_BYTES:
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

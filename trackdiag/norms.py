"""Batched norms of tensor lists: the foreach kernels every gradient/parameter probe is built on.

``tensor_norms`` is one ``_foreach_norm`` launch for a whole list (no host sync, no per-tensor
Python loop beyond building the list); ``max_abs`` the largest magnitude over a list. Both return
device tensors. :class:`~trackdiag.layers.LayerIndex` caches the gradient and parameter norms per
optimizer-step hook, so the probes that read them at the same hook share one kernel launch.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

CHUNK = 1 << 22  # values per concatenated chunk (a transient copy of at most 16 MB in fp32)


def flat_chunks(tensors: list[torch.Tensor], dtype: torch.dtype, limit: int | None = None) -> Iterator[torch.Tensor]:
    """``tensors`` flattened, cast to ``dtype`` and concatenated into runs of at most ``limit``
    (default ``CHUNK``) values; a larger tensor is a run of its own. Many small tensors then cost a
    few kernels instead of a few per tensor (CPU pays ~1.5 us per tensor per kernel)."""
    limit = CHUNK if limit is None else limit
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if run and size + t.numel() > limit:
            yield run[0] if len(run) == 1 else torch.cat(run)
            run, size = [], 0
        run.append(t.detach().reshape(-1).to(dtype))
        size += t.numel()
    if run:
        yield run[0] if len(run) == 1 else torch.cat(run)


def tensor_norms(tensors: list[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """Per-tensor norms as one 1-D tensor (foreach kernel; no host sync)."""
    if not tensors:
        return torch.zeros(0)
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        return torch.stack(torch._foreach_norm(tensors, ord))
    dev = tensors[0].device
    return torch.stack([torch.linalg.vector_norm(t, ord).to(dev) for t in tensors])


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Largest absolute value over all ``tensors`` (0-d, on device), the cheapest way per case:
    a few tensors: one ``aminmax`` each; many tensors on CUDA: the inf-norm foreach kernel; many on
    CPU (where that kernel is ~3-15x slower than the L2 one): ``aminmax`` over concatenated chunks of
    at most ``CHUNK`` values (a transient copy of at most 16 MB)."""
    if not tensors:
        return torch.zeros(())
    if len({t.device for t in tensors}) > 1:
        return tensor_norms(tensors, math.inf).max()
    if len(tensors) <= 64:
        lo_hi = torch.stack([torch.stack(torch.aminmax(t.detach())) for t in tensors])
        return lo_hi.abs().max()
    if tensors[0].device.type != "cpu":
        return tensor_norms(tensors, math.inf).max()
    dtype = tensors[0].dtype if all(t.dtype == tensors[0].dtype for t in tensors) else torch.float64
    return torch.stack([torch.stack(torch.aminmax(x)) for x in flat_chunks(tensors, dtype)]).abs().max()

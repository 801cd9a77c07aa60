"""Device reductions the gradient/parameter probes are built on: batched norms of tensor lists.

``tensor_norms`` is one ``_foreach_norm`` launch for a whole list (no host sync, no per-tensor
Python loop beyond building the list); ``max_abs`` the largest magnitude over a list; ``all_finite``
whether a list holds no NaN/Inf; ``bin_counts`` a sync-free ``bincount``; ``stack_scalars`` 0-d
values into one vector. All return device tensors. :class:`~trackdiag.capture.layers.LayerIndex` caches the gradient and parameter norms per
optimizer-step hook, so the probes that read them at the same hook share one kernel launch.
"""
from __future__ import annotations

import functools
import math
from typing import Iterator

import torch
from torch._utils import _flatten_dense_tensors

CHUNK = 1 << 22  # values per concatenated chunk (a transient copy of at most 16 MB in fp32)
SMALL = 4096  # on the CPU, tensors below this many values are normed as concatenated chunks (copying a
# tensor costs less than the foreach kernel's ~1.5-5 us per tensor there); larger ones by the foreach kernel
DOT = 1 << 16  # on the CPU, contiguous fp32/fp64 tensors from this many values: one BLAS dot each (see global_norm)
_DOT_DTYPES = (torch.float32, torch.float64)
NORM_CHUNK = 1 << 18  # the every-step norm's chunks: 1 MB copies, reused by the allocator, not fresh pages


def flat_chunks(tensors: list[torch.Tensor], dtype: torch.dtype, limit: int | None = None) -> Iterator[torch.Tensor]:
    """``tensors`` flattened, cast to ``dtype`` and concatenated into runs of at most ``limit``
    (default ``CHUNK``) values; a larger tensor is a run of its own. Many small tensors then cost a
    few kernels instead of a few per tensor (CPU pays ~1.5 us per tensor per kernel)."""
    limit = CHUNK if limit is None else limit
    run: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        n = t.numel()
        if run and size + n > limit:
            yield _joined(run, dtype)
            run, size = [], 0
        run.append(t)
        size += n
    if run:
        yield _joined(run, dtype)


def _joined(run: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One flat ``dtype`` copy of ``run``: one C++ call for the whole run (``cat`` promotes mixed
    dtypes; a Python ``flatten`` per tensor cost ~0.8 us each, 2.4 ms for 3,000 tensors)."""
    with torch.no_grad():
        flat = run[0].reshape(-1) if len(run) == 1 else _flatten_dense_tensors(run)
        return flat.to(dtype)


def tensor_norms(tensors: list[torch.Tensor], ord: float = 2.0, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-tensor norms as one 1-D tensor (foreach kernel; no host sync). ``dtype``: accumulate and
    return in this dtype (fp32 for fp16/bf16 tensors, whose squares overflow above ~256)."""
    if not tensors:
        return torch.zeros(0)
    devices = {t.device for t in tensors}
    if len(devices) == 1:
        return torch.stack(torch._foreach_norm(tensors, ord, dtype=dtype) if dtype is not None else torch._foreach_norm(tensors, ord))
    dev = tensors[0].device
    return torch.stack([torch.linalg.vector_norm(t, ord, dtype=dtype).to(dev) for t in tensors])


def fp32_norm(t: torch.Tensor, ord: float = 2.0) -> torch.Tensor:
    """``t``'s norm as a 0-d fp32 tensor: accumulated in fp32 for fp16/bf16 (their squares overflow above ~256)
    and fp32, in fp64 for fp64 (a ``.double()`` model: torch refuses to narrow it inside the norm)."""
    if t.dtype is torch.float64:
        return torch.linalg.vector_norm(t, ord).float()
    return torch.linalg.vector_norm(t, ord, dtype=torch.float32)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A dense real tensor with the same L2 norm and NaN/Inf as ``t``: a sparse tensor's coalesced
    values, a complex tensor's magnitudes."""
    if t.layout is not torch.strided:
        t = t.coalesce().values() if t.layout is torch.sparse_coo else t.to_dense()
    return t.abs() if t.is_complex() else t


def global_norm(tensors: list[torch.Tensor], low_precision: bool = False) -> torch.Tensor:
    """The L2 norm of all ``tensors`` together (0-d fp32 on the first one's device), the cheapest way.

    On the CPU the tensors are split by size (one host pass over the list, no device work):
    large contiguous fp32/fp64 tensors (>= ``DOT``) by one ``torch.dot`` each (BLAS: 0.35 vs 0.52 ms
    for 17 MB in 10 tensors against the foreach kernel, and closer to a float64 reference: 1e-5 vs
    8e-5 relative at 4M values); many small ones (< ``SMALL``) concatenated in chunks
    (:func:`flat_chunks`) and normed a few kernels at a time (0.6 vs 5 ms for 1,000 tensors of 1k
    values: the foreach kernel pays ~5 us per tensor there); the rest by one foreach kernel (a small
    model without large tensors: the foreach norms' own norm, ``clip_grad_norm_``'s arithmetic, 3
    ops). Elsewhere one foreach kernel. Sparse/complex tensors take :func:`grad_norms`."""
    if not tensors:
        return torch.zeros(())
    if tensors[0].device.type == "cpu" and not low_precision:
        try:
            return _cpu_global_norm(tensors)
        except (RuntimeError, NotImplementedError):
            pass
    return torch.linalg.vector_norm(grad_norms(tensors, low_precision))


def _cpu_global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    small: list[torch.Tensor] = []
    mid: list[torch.Tensor] = []
    squares: list[torch.Tensor] = []
    for t in tensors:  # one host pass over the list (no device work)
        n = t.numel()
        if n >= DOT and t.dtype in _DOT_DTYPES and t.layout is torch.strided and t.is_contiguous():
            flat = t.view(-1)
            squares.append(torch.dot(flat, flat).float())
        else:
            (small if n < SMALL else mid).append(t)
    if len(small) > 64:  # many small tensors: the per-tensor kernel cost dominates, copy them instead
        squares += [torch.dot(c, c).float() for c in flat_chunks(small, torch.float32, NORM_CHUNK)]
    else:
        mid += small
    if mid and not squares:  # no large tensor (a small model): clip_grad_norm_'s own arithmetic, 3 ops
        return torch.linalg.vector_norm(grad_norms(mid))
    if mid:
        squares.append(grad_norms(mid).square().sum())
    return torch.stack(squares).sum().sqrt() if len(squares) > 1 else squares[0].sqrt()


def grad_norms(grads: list[torch.Tensor], low_precision: bool = False) -> torch.Tensor:
    """Per-tensor L2 norms of gradients, in fp32: one foreach kernel in the usual case (accumulated
    in fp32 when some are fp16/bf16); sparse and complex gradients, mixed precisions and several
    devices take a per-tensor path over :func:`plain` values."""
    try:
        if low_precision:
            return tensor_norms(grads, dtype=torch.float32)
        return tensor_norms(grads).float()
    except (RuntimeError, NotImplementedError):
        dev = grads[0].device
        return torch.stack([torch.linalg.vector_norm(plain(g).float()).to(dev) for g in grads])


def max_abs(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Largest absolute value over all ``tensors`` (0-d, on device), the cheapest way per case:
    a few tensors: one ``aminmax`` each; many tensors on CUDA: the inf-norm foreach kernel; many on
    CPU (where that kernel is ~3-15x slower than the L2 one): one ``aminmax`` per tensor from
    ``DOT`` values, the smaller ones concatenated in 1 MB chunks (copying 17 MB of large tensors
    into chunks cost 3x their ``aminmax``; an ``aminmax`` per 33 KB tensor, 2x their copy)."""
    if not tensors:
        return torch.zeros(())
    if any(t.layout is not torch.strided or t.is_complex() for t in tensors):
        tensors = [plain(t) for t in tensors]
    if len({t.device for t in tensors}) > 1:
        return tensor_norms(tensors, math.inf).max()
    if len(tensors) <= 64:
        lo_hi = torch.stack([torch.stack(torch.aminmax(t.detach())) for t in tensors])
        return lo_hi.abs().max()
    if tensors[0].device.type != "cpu":
        return tensor_norms(tensors, math.inf).max()
    small: list[torch.Tensor] = []
    parts: list[torch.Tensor] = []
    for t in tensors:  # large ones: an aminmax each, no copy
        if t.numel() < DOT:
            small.append(t)
        else:
            parts.append(torch.stack(torch.aminmax(t.detach())).float())
    if small:
        dtype = small[0].dtype if all(t.dtype == small[0].dtype for t in small) else torch.float64
        parts += [torch.stack(torch.aminmax(x)).float() for x in flat_chunks(small, dtype, NORM_CHUNK)]
    return torch.stack(parts).abs().max()


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """True (0-d bool, on device) when no tensor holds a NaN or Inf, without computing norms.

    Uses the kernel ``GradScaler`` unscales with, ``_amp_foreach_non_finite_check_and_unscale_`` with
    an inverse scale of exactly 1: it returns each value unchanged (its ``inv_scale == 1`` branch; the
    values are rewritten bit for bit, the version counter is not bumped), and its one C++ loop over
    the list is ~5x cheaper on CPU than a norm per tensor (0.6 vs 3 ms for 1,000 tensors). Tensors it
    does not take (sparse, complex, overlapping views, several devices) fall back to per-tensor norms.
    Unlike a norm, it does not call a huge but finite tensor non-finite (a norm can overflow)."""
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    dev = tensors[0].device
    found = torch.zeros(1, device=dev)
    try:  # one call for the whole list: mixed dtypes take the kernel's per-tensor route, no Python loop here
        with torch.no_grad():
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, torch.ones(1, device=dev))
    except (RuntimeError, NotImplementedError):
        return torch.isfinite(tensor_norms([t.detach() for t in tensors])).all()
    return found[0] == 0


def bin_counts(idx: torch.Tensor, n: int) -> torch.Tensor:
    """``torch.bincount(idx, minlength=n)`` for ``0 <= idx < n``, without its host sync: CUDA's
    ``bincount`` reads the largest index back to size its output; a ``scatter_add_`` into ``n``
    counts does not (CPU: ~2x slower than ``bincount``, 1.2 ms per million values)."""
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))


def stack_scalars(values: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """0-d (or one-element) tensors as one 1-D ``dtype`` vector on the first one's device: a single
    ``stack`` in the usual case (one dtype, one device, 0-d), a per-value conversion otherwise."""
    try:
        return torch.stack(values).to(dtype)
    except RuntimeError:
        dev = values[0].device
        return torch.stack([v.reshape(()).to(dev, dtype) for v in values])


def cat_chunks(chunks: list[torch.Tensor]) -> torch.Tensor:
    """1-D chunks of one series (a window stacked a part at a time) as one vector on the first one's device, in their
    common dtype; a single chunk as it is."""
    if len(chunks) == 1:
        return chunks[0]
    dtype = functools.reduce(torch.promote_types, (c.dtype for c in chunks))
    return torch.cat([c.to(chunks[0].device, dtype) for c in chunks])

"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``) in the replay
and pre-flight paths: many element-wise ops (``ne``, ``isfinite``) have no sparse kernel, so these
helpers read a sparse tensor through its coalesced values, which hold every stored element (the
others are zeros: finite, and not "non-zero"). Each helper that returns a Python value reads one
value back to the host: replay and pre-flight paths only, never per step.
"""
from __future__ import annotations

import torch


def stored_values(t: torch.Tensor) -> torch.Tensor:
    """The stored elements of ``t``: its coalesced values when sparse (COO, CSR, ...), else ``t``."""
    if t.layout is torch.strided:
        return t
    if t.layout is torch.sparse_coo:
        return t.coalesce().values()
    return t.values()


def finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d device bool: ``t`` holds no NaN/Inf (sparse tensors by their stored values). No host read."""
    return torch.isfinite(stored_values(t.detach())).all()


def all_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds no NaN/Inf (one host read)."""
    return bool(finite_flag(t))


def any_nonzero(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a non-zero value (one host read)."""
    return bool(stored_values(t.detach()).any())


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided tensor (sparse ones densified: for comparisons that need every element)."""
    return t if t.layout is torch.strided else t.to_dense()

"""Which process this is under ``torch.distributed``, and the local shard of a DTensor.

No collective is called here: each helper reads the process group's state (a few Python calls).
"""
from __future__ import annotations

from typing import Any

import torch


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank (0 outside ``torch.distributed``)."""
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of ranks (1 outside ``torch.distributed``)."""
    return torch.distributed.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """True on rank 0 and outside ``torch.distributed``: the process that opens runs and writes files."""
    return rank() == 0


def is_sharded(t: Any) -> bool:
    """A DTensor (FSDP2 parameter or gradient), detected without importing ``torch.distributed.tensor``."""
    return hasattr(t, "to_local") and hasattr(t, "placements")


def local(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds of a DTensor; any other tensor unchanged."""
    return t.to_local() if is_sharded(t) else t

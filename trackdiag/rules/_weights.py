"""Did the weights move out of proportion? The ``weights`` evidence of the dynamics rules: an
update-to-weight ratio above ``limit`` (1: a step changed a layer by more than its own size, never
healthy) measured by the update probe at a logging step in the window. Nothing new is measured.
"""
from __future__ import annotations

from typing import Sequence

from trackdiag.core.record import Record
from trackdiag.rules.base import layer_values


def weights_moved(records: Sequence[Record], comp: str, lo: int, hi: int, limit: float = 1.0) -> bool:
    """Whether an update ratio above ``limit`` was measured in component ``comp`` between ``lo`` and ``hi``."""
    key = f"diag/{comp}/update/ratio" if comp else "diag/update/ratio"
    return any(lo <= r.step <= hi and any(v > limit for v in layer_values(r, key).values()) for r in records)

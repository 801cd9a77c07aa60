"""AMP probe: ``diag/amp/scale``, the ``GradScaler``'s current loss scale (read from its device
tensor with the other diagnostics, not with ``get_scale()``, which syncs)."""
from __future__ import annotations

from typing import Any

from trackdiag.capture.context import ProbeContext
from trackdiag.probes.base import Probe


class AmpProbe(Probe):
    name = "amp"

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        scaler = ctx.scaler
        if scaler is None or not scaler.is_enabled() or getattr(scaler, "_scale", None) is None:
            return {}
        return {"diag/amp/scale": scaler._scale.detach().reshape(())}

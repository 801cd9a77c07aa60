"""Learning-rate probe: ``diag/[<c>/]opt/lr`` (one param group) or ``diag/[<c>/]opt/lr/<group>``
(group ``name`` if set, else its index), and beside each a group's non-zero ``weight_decay`` as
``diag/[<c>/]opt/weight_decay[/<group>]``. Cost: reads ``param_groups``; a tensor LR is copied with the
other diagnostics."""
from __future__ import annotations

from typing import Any

from trackdiag.capture.context import ProbeContext
from trackdiag.probes.base import Probe


class LrProbe(Probe):
    name = "lr"

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for comp in ctx.components:
            if comp.optimizer is None:
                continue
            groups = comp.optimizer.param_groups
            for i, g in enumerate(groups):
                suffix = "opt/lr" if len(groups) == 1 else f"opt/lr/{g.get('name', i)}"
                lr = g.get("lr")
                if lr is not None:
                    out[comp.key(suffix)] = lr
                wd = g.get("weight_decay")
                if wd:
                    out[comp.key(suffix.replace("opt/lr", "opt/weight_decay", 1))] = wd
        return out

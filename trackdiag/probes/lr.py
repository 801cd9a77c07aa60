"""Learning-rate probe: ``diag/[<c>/]opt/lr`` (one param group) or ``diag/[<c>/]opt/lr/<group>``
(group ``name`` if set, else its index), and beside each a group's non-zero ``weight_decay`` as
``diag/[<c>/]opt/weight_decay[/<group>]``. Once the loop has replaced an optimizer by a new one of its class over the
same parameters, the table ``diag/[<c>/]opt/recreated``: ``steps`` (optimizer steps in a row, up to the latest, each by
a new optimizer; 0 once one was kept), ``since`` (the step that streak began), ``total`` and ``stateful`` (1: a replaced
optimizer held state, moments or momentum, that its successor started without). Once an optimizer stepped again on
the gradients of its last step (:mod:`trackdiag.capture.resteps`), the table ``diag/[<c>/]opt/restepped``: ``steps``
(such repeats among the last 10 optimizer steps), ``since`` (the first of them), ``total``. Cost: reads
``param_groups``; a tensor LR is copied with the other diagnostics."""
from __future__ import annotations

from typing import Any

import numpy as np

from trackdiag.capture.context import ProbeContext
from trackdiag.core.record import Record
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

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        super().publish(ctx, values, record)
        for comp in ctx.components:
            rec = comp.recreations
            if rec.total:
                record.tables[comp.key("opt/recreated")] = {"steps": float(rec.current()), "since": float(rec.since),
                                                            "total": float(rec.total), "stateful": float(rec.stateful)}
            again = comp.resteps
            if again.total:
                repeats, since = again.repeats()
                record.tables[comp.key("opt/restepped")] = {"steps": float(repeats), "since": float(since),
                                                            "total": float(again.total)}

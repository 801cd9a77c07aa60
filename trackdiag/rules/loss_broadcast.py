"""``loss_broadcast``: the loss compared outputs and targets of shapes that broadcast (the ``loss_shape`` probe's
measurements, judged here)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule
from trackdiag.util.stats import rounding_tolerance

FUNCTIONS = ("mse", "l1", "smooth_l1")  # the ``loss_shape`` table's keys: broadcast means, and ``<fn>_aligned``
NAMES = {"mse": "MSE", "l1": "L1", "smooth_l1": "smooth-L1"}


def judge(table: dict[str, float]) -> tuple[str, bool, float, float] | None:
    """(function, sum reduction, broadcast value, aligned value) when the table's loss equals a loss function's broadcast
    value (mean, or sum over the broadcast elements) to within its own rounding (64 ulps of the loss's dtype, ``eps``)
    and its aligned value is at least 16 times that far off; else None.

    For MSE the two values differ by twice the outputs' covariance with the targets, which is small beside the loss
    for a model that has learnt nothing yet (targets in raw units, outputs near 0: 1e-4 of the loss at a tabular
    regression's first step). A loop whose loss is the aligned one is off the aligned value by its rounding alone, so
    it can never be 16 times further from it than the tolerance; a broadcast one whose outputs do not yet covary with
    the targets is measured again at a later step (the probe's ``checks``)."""
    loss, eps = table["loss"], table["eps"]
    if not math.isfinite(loss):
        return None
    for fn in FUNCTIONS:
        b, a = table[fn], table[f"{fn}_aligned"]
        for summed, (bb, aa) in ((False, (b, a)), (True, (b * table["elements"], a * table["aligned_elements"]))):
            tol = rounding_tolerance(loss, bb, eps)
            if math.isfinite(bb) and abs(loss - bb) <= tol and not (math.isfinite(aa) and abs(loss - aa) < 16 * tol):
                return fn, summed, bb, aa
    return None


def _shape(table: dict[str, float]) -> str:
    dims = [int(table[k]) for k in sorted(table, key=int)]
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


class LossBroadcast(Rule):
    """Fires once, at the first step the two shapes were handed over, when a measured step's loss equals an
    elementwise loss (MSE, L1, smooth-L1/Huber; mean or sum) taken over the broadcast of the output and the targets,
    ``(N, 1)`` against ``(N,)`` read as ``(N, N)``, and not over the two aligned (:func:`judge`, on the ``loss_shape``
    probe's table ``diag/data/loss_shape``): every output is pulled towards every target, so the model can only learn
    their mean. ``unambiguous`` (no correctly wired loss has that value) and ``loss``: critical."""

    kind = "loss_broadcast"
    hint = ("Give the loss an output and a target of one shape: pred.squeeze(-1) (or y.unsqueeze(-1), y.view_as(pred)) "
            "before F.mse_loss / F.l1_loss / F.smooth_l1_loss. Torch warned about it once ('Using a target size ... "
            "different to the input size'); the run so far has learnt the targets' mean.")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fired = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        table = record.tables.get("diag/data/loss_shape")
        if self._fired or not table:
            return []
        found = judge(table)
        if found is None:
            return []
        self._fired = True
        fn, summed, broadcast, aligned = found
        out = _shape(record.tables.get("diag/data/loss_shape_outputs", {}))
        tgt = _shape(record.tables.get("diag/data/loss_shape_targets", {}))
        name = NAMES[fn] + (" (reduction='sum')" if summed else "")
        told = (f"; with the output reshaped to the targets' shape it would be {aligned:.4g}" if aligned == aligned
                else "")
        step, first = int(table["step"]), int(table.get("first", table["step"]))
        since = f" (outputs and targets of these shapes since step {first})" if first < step else ""
        msg = (f"the loss at step {step} ({table['loss']:.4g}) is {name} between outputs {out} and targets {tgt} "
               f"broadcast to {int(table['elements'])} pairs{since}: every output is compared with every target{told}.")
        return [self.make(min(first, step), msg, table["loss"], broadcast, "loss", ["unambiguous", "loss"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))

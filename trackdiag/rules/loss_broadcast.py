"""``loss_broadcast``: the loss compared outputs and targets of shapes that broadcast (keys of the ``loss_shape`` probe)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


FUNCTIONS = ("MSE", "L1", "smooth-L1")  # the ``fn`` index of the ``loss_shape`` probe's table


def _shape(table: dict[str, float]) -> str:
    dims = [int(table[k]) for k in sorted(table, key=int)]
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"


class LossBroadcast(Rule):
    """Fires once, at the first step the two shapes were handed over, when a step's loss was found to equal an elementwise loss (MSE, L1, smooth-L1/Huber; mean or
    sum) taken over the broadcast of the output and the targets, ``(N, 1)`` against ``(N,)`` read as ``(N, N)``, and
    not over the two aligned: every output is pulled towards every target, so the model can only learn their mean.
    ``unambiguous`` (no correctly wired loss has that value) and ``loss``: critical."""

    kind = "loss_broadcast"
    hint = ("Give the loss an output and a target of one shape: pred.squeeze(-1) (or y.unsqueeze(-1), y.view_as(pred)) "
            "before F.mse_loss / F.l1_loss / F.smooth_l1_loss. Torch warned about it once ('Using a target size ... "
            "different to the input size'); the run so far has learnt the targets' mean.")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fired = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        found = record.tables.get("diag/data/loss_broadcast")
        if self._fired or not found:
            return []
        self._fired = True
        out = _shape(record.tables.get("diag/data/loss_broadcast_outputs", {}))
        tgt = _shape(record.tables.get("diag/data/loss_broadcast_targets", {}))
        fn = FUNCTIONS[int(found["fn"])] + (" (reduction='sum')" if found["sum"] else "")
        aligned = found["aligned"]
        told = (f"; with the output reshaped to the targets' shape it would be {aligned:.4g}" if aligned == aligned
                else "")
        step, first = int(found["step"]), int(found.get("first", found["step"]))
        since = f" (outputs and targets of these shapes since step {first})" if first < step else ""
        msg = (f"the loss at step {step} ({found['loss']:.4g}) is {fn} between outputs {out} and targets {tgt} "
               f"broadcast to {int(found['elements'])} pairs{since}: every output is compared with every target{told}.")
        return [self.make(min(first, step), msg, found["loss"], found["broadcast"], "loss", ["unambiguous", "loss"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))

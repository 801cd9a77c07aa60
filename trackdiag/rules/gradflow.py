"""``grad_flow``: the gradient shrinks (or grows) by orders of magnitude from the last layer to the first."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import Rule
from trackdiag.util.modnames import layer_label


class GradFlow(Rule):
    """Fires when ``diag/grad/flow_ratio`` (first-layer / last-layer gradient norm) stays below
    ``min_ratio`` (1e-4: vanishing towards the input) or above ``max_ratio`` (1e4: exploding towards the
    input) for ``patience`` (3) consecutive measurements. Unlike ``grad_vanishing`` (absolute norms) it
    is scale-free, so it also catches depth-wise vanishing under a large loss scale. ``where`` is the
    first layer; ``step`` the first measurement of the streak."""

    kind = "grad_flow"
    hint = ("Gradients do not flow through depth: use ReLU-family activations instead of sigmoid/tanh, Kaiming/Xavier "
            "init, residual connections and normalisation layers (BatchNorm/LayerNorm); for growth towards the input, "
            "clip gradients and check the init scale.")

    def __init__(self, *, min_ratio: float = 1e-4, max_ratio: float = 1e4, patience: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.min_ratio, self.max_ratio, self.patience = min_ratio, max_ratio, patience
        self._streaks = Streaks(patience)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            r = record.scalars.get(comp.key("grad/flow_ratio"))
            if r is None or not math.isfinite(r):
                continue
            ends = list(record.tables.get(comp.key("grad/flow"), {}))
            first, last = (layer_label(comp, e) for e in ends) if len(ends) == 2 else ("the first layer", "the last layer")
            where = first if len(ends) == 2 else comp.name
            for low, thr in ((True, self.min_ratio), (False, self.max_ratio)):
                key = f"{comp.name}|{'low' if low else 'high'}"
                if self._streaks.bump(key, r < thr if low else r > thr, record.step):
                    what = "vanishes" if low else "explodes"
                    msg = (f"the gradient {what} towards the input: the gradient norm of the first layer, {first}, is "
                           f"{r:.3g} x that of the last, {last} ({'<' if low else '>'} {thr:g}), for {self.patience} "
                           f"measurements.")
                    out.append(self.make(self._streaks.start(key), msg, r, thr, where, ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)

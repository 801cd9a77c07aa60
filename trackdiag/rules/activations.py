"""``dead_units``: activation layers whose units never fire (ReLU family) or sit saturated (sigmoid/tanh)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import Rule, layer_values
from trackdiag.util.modnames import layer_label

_FAMILIES = {"dead": "never activate (output <= 0)", "saturated": "sit saturated on the flat tails"}


class DeadUnits(Rule):
    """More than ``threshold`` (0.5) of an activation module's units inactive (or saturated) on every
    sample of the ``activations`` probe's window, at ``patience`` (2) consecutive measurements: an
    ``info`` finding (healthy ReLU networks, regression heads above all, often run half their units
    dead). More than ``severe`` (0.9) at ``patience`` measurements is ``persistent``: the layer has
    all but stopped passing signal. ``where`` is the module; ``step`` the first measurement."""

    kind = "dead_units"
    hint = ("Dead ReLUs: lower the learning rate, check the init and the bias before the activation (a large negative "
            "bias kills units), use LeakyReLU/GELU, add normalisation (BatchNorm/LayerNorm) before the activation. "
            "Saturated sigmoid/tanh: normalise the inputs, use Xavier init, prefer ReLU-family activations.")

    def __init__(self, *, threshold: float = 0.5, severe: float = 0.9, patience: int = 2, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.severe, self.patience = threshold, severe, patience
        self._streaks = Streaks(patience)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            for fam, what in _FAMILIES.items():
                for module, frac in layer_values(record, comp.key(f"act/{fam}_fraction")).items():
                    for level, line, ev in ((1, self.threshold, []), (2, self.severe, ["persistent"])):
                        key = f"{comp.name}|{fam}|{module}|{level}"
                        if not self._streaks.bump(key, math.isfinite(frac) and frac > line, record.step):
                            continue
                        where = layer_label(comp, module)
                        msg = (f"{frac:.0%} of the units of {where} {what} over every sampled batch, for "
                               f"{self.patience} consecutive measurements.")
                        out.append(self.make(self._streaks.start(key), msg, frac, line, where, ev))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)

"""``symmetric_units``: a layer whose output units are all one unit, update after update (the ``symmetry`` probe's
table ``diag/[<c>/]model/symmetric_units``)."""
from __future__ import annotations

from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer
from trackdiag.util.modnames import layer_label, layers_named


class SymmetricUnits(OncePer):
    """Fires when a trained ``Linear``/``Conv`` layer's output units have the same weights (to 1e-6 of their scale)
    at two checks of the ``symmetry`` probe in a row, updated in between: the layer was initialised to one value
    (``nn.init.constant_``, ``zeros_``) and every unit gets the same gradient, so the units never differ and the layer
    computes one feature. ``step``: the logging step that found it; ``persistent`` (a warning). Once per component."""

    kind = "symmetric_units"
    hint = ("Initialise weights randomly: drop nn.init.constant_/zeros_ on hidden layers (keep PyTorch's default "
            "init, or use nn.init.kaiming_uniform_/xavier_uniform_); a constant is fine for biases, and zeros only for "
            "a final layer (or a residual branch's last layer) whose inputs differ.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            table = record.tables.get(comp.key("model/symmetric_units"))
            if not table or not self.first(comp.name):
                continue
            first = next(iter(table))
            units = int(table[first])
            more = f" Same in {len(table)} layers: {layers_named(comp, table)}." if len(table) > 1 else ""
            msg = (f"every one of the {units} output units of {layer_label(comp, first)} has the same weights at step "
                   f"{record.step}, after training: the layer was initialised to one value, so each unit gets the "
                   f"same gradient and they never differ; the layer computes one feature {units} times.{more}")
            out.append(self.make(record.step, msg, float(len(table)), 1.0, layer_label(comp, first), ["persistent"]))
        return out

"""Set-up rules: ``param_not_optimized`` (trainable parameters that no optimizer steps)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule
from trackdiag.util.modnames import layers_named


class ParamNotOptimized(Rule):
    """Once per component when the model has parameters that require a gradient and receive one but
    are in none of its optimizers (the ``setup`` probe's table ``setup/unoptimized``): they never
    learn (``unambiguous``). ``where`` names the layers (the largest first); a layer frozen on purpose
    (``requires_grad=False``) or one that gets no gradient (a later phase) is not reported. When the optimizers
    step none of the model's parameters, only other tensors (``setup/inputs``: an input optimised, as style
    transfer, adversarial examples and feature visualisation do), the model is fixed by intent: an ``info``
    finding that its gradients are computed and never used, with the hint to freeze it."""

    kind = "param_not_optimized"
    hint = ("Build the optimizer after the final model (after replacing a head or adding layers), pass "
            "model.parameters() (or every param group you meant), or call optimizer.add_param_group({...}) for "
            "the new layers. If they should not train, set requires_grad_(False) on them.")
    input_hint = ("Nothing is wrong if the model is meant to stay fixed while the optimizer steps an input. To save "
                  "the backward through its weights, call model.requires_grad_(False) before the loop (the input's "
                  "gradient is computed all the same).")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            table = record.tables.get(comp.key("setup/unoptimized"))
            if not table:
                continue
            where, total = layers_named(comp, table), sum(table.values())
            stepped = record.tables.get(comp.key("setup/inputs"))
            if stepped:
                msg = (f"the optimizer steps {stepped.get('tensors', 0):.0f} tensor(s) ({stepped.get('values', 0):.0f} "
                       f"values) that are not the model's parameters (an input optimised: style transfer, adversarial "
                       f"examples, feature visualisation); the model is held fixed, but {len(table)} layer(s) with "
                       f"{total:.0f} trainable values receive gradients that are never used: {where}.")
                out.append(dataclasses.replace(self.make(record.step, msg, total, 0.0, where, []), hint=self.input_hint))
                continue
            msg = (f"{len(table)} layer(s) with {total:.0f} trainable values are in no optimizer: {where}. They receive "
                   f"gradients but are never updated.")
            out.append(self.make(record.step, msg, total, 0.0, where, ["unambiguous"]))
        return out

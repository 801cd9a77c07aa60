"""``eval_mode``: the optimizer steps a model left in eval mode (the ``modes`` probe)."""
from __future__ import annotations

from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule
from trackdiag.util.modnames import layers_named


class EvalMode(Rule):
    """At the first optimizer step taken while the model (its root module) is in eval mode and has
    modules whose behaviour depends on it (dropout with ``p > 0``, BatchNorm with running statistics):
    dropout is off and the normalisation statistics are frozen while the weights train. No healthy
    run does this on purpose with the whole model (``unambiguous``); BatchNorm layers put in eval
    inside a model in train mode (a fine-tuned backbone's frozen statistics) are a choice and are
    not reported, nor is a model kept in eval with nothing there to train (the probe emits nothing when
    no module in eval mode holds a parameter that requires a gradient and that the optimizer steps: a
    frozen feature extractor, alone or under a trainable head in train mode). A model with no such
    module is an ``info`` finding (only a forward that reads ``self.training`` itself, a functional
    dropout, would behave differently). ``step`` is that step, ``where`` the modules."""

    kind = "eval_mode"
    hint = ("Call model.train() before the training loop and again after every validation pass (model.eval() "
            "for validation, then model.train()). To freeze only BatchNorm statistics, put those layers in eval "
            "mode after model.train().")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            meta = record.tables.get(comp.key("model/eval_mode_step"))
            if meta is None:
                continue
            modules = record.tables.get(comp.key("model/eval_modules"), {})
            step = int(meta.get("step", record.step))
            model = f"component {comp.name!r}" if comp.name else "the model"
            if not modules:  # nothing in it behaves differently, unless its forward reads self.training itself
                msg = (f"the optimizer stepped {model} while it was in eval mode; it has no dropout or BatchNorm module "
                       f"(a functional F.dropout(training=self.training) would be off).")
                out.append(self.make(step, msg, 0.0, 0.0, comp.name or "(root)"))
                continue
            dropout = sum(1 for v in modules.values() if v == 1.0)
            norm = len(modules) - dropout
            what = ", ".join(x for x in (f"{dropout} dropout" if dropout else "", f"{norm} normalisation" if norm else "") if x)
            msg = (f"the optimizer stepped {model} while it was in eval mode ({what} module(s) behave as at inference: "
                   f"{layers_named(comp, modules)}).")
            out.append(self.make(step, msg, float(len(modules)), 0.0, layers_named(comp, modules), ["unambiguous"]))
        return out

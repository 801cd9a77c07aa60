"""``grads_overclipped``: every step's gradient clipped to a sliver of its norm under an optimizer whose update scales
with it (keys of the ``grads`` probe)."""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule

#: optimizers whose step is proportional to the gradient it is given; adaptive ones (Adam and its kin, RMSprop,
#: Adagrad, Adadelta) divide its scale out, Rprop keeps only its sign, L-BFGS searches its step length
PROPORTIONAL = (torch.optim.SGD, torch.optim.ASGD)


class GradsOverclipped(Rule):
    """Fires when something between the backward pass and an SGD step (``clip_grad_norm_`` with a ``max_norm`` far
    below the gradient's norm) scaled the gradient to under ``coef`` (1 %) of its pre-clip norm
    (``grad/clip_coef``) at ``patience`` (3) measurements in a row. SGD's update is ``lr x gradient``: each step is
    then over 100x smaller than the learning rate says, the run crawls and can sit at chance level while every
    norm looks tame. Clipping is for the rare spike: the word-language-model example's 0.25 against norms of 1-5
    gives 0.05-0.25, a GPT's 1.0 clips its first steps only. Not judged: adaptive optimizers (Adam, AdamW, RMSprop,
    Adagrad: the scale is divided out, clipping to a sliver changes little), a coefficient of 0 (the gradients
    wiped: ``grads_wiped``'s), a component several optimizers step. ``step``: the first of the measurements;
    ``persistent`` (a warning). Once per component."""

    kind = "grads_overclipped"
    hint = ("Raise clip_grad_norm_'s max_norm to about the gradient's usual norm (its return value: the pre-clip norm) "
            "so that only spikes are clipped, or drop the clipping and lower the learning rate; with a very small "
            "max_norm on purpose, the learning rate has to be that much larger (or use Adam, which ignores the scale).")

    def __init__(self, *, coef: float = 0.01, patience: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.coef, self.patience = coef, max(1, patience)
        self._streak: dict[str, list[tuple[int, float, float]]] = {}  # component -> (step, coef, clipped norm)
        self._told: set[str] = set()

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            coef = record.scalars.get(comp.key("grad/clip_coef"))
            if coef is None or comp.name in self._told:
                continue  # not measured at this record (no due step, or nothing touched the gradients)
            if not (0.0 < coef < self.coef) or len(comp.optimizers) != 1 or \
                    not isinstance(comp.optimizers[0], PROPORTIONAL):
                self._streak.pop(comp.name, None)
                continue
            streak = self._streak.setdefault(comp.name, [])
            streak.append((record.step, coef, record.scalars.get(comp.key("grad/clipped_norm"), math.nan)))
            if len(streak) >= self.patience:
                self._told.add(comp.name)
                out.append(self._alert(comp, streak))
        return out

    def _alert(self, comp: Component, streak: list[tuple[int, float, float]]) -> Alert:
        first, last = streak[0][0], streak[-1][0]
        worst = max(c for _, c, _ in streak)
        clipped = streak[-1][2]
        lrs = sorted({float(g["lr"]) for g in comp.optimizers[0].param_groups if "lr" in g})
        lr = f" (lr {lrs[0]:.3g})" if len(lrs) == 1 else ""
        msg = (f"at every measured step from {first} to {last} ({len(streak)} checks) the gradient reached "
               f"{type(comp.optimizers[0]).__name__}{lr} scaled to at most {worst:.2g} of its pre-clip norm: each update "
               f"is {1 / worst:.0f}x or more smaller than the learning rate says. The clipped norm ({clipped:.3g}: "
               f"clip_grad_norm_'s max_norm) is far below the gradient's own ({clipped / streak[-1][1]:.3g}), so every "
               f"step is clipped, not the rare spike.")
        return self.make(first, msg, worst, self.coef, comp.key("grad/clip_coef"), ["persistent"])

    def state_dict(self) -> dict[str, Any]:
        return {"told": sorted(self._told)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._told = set(state.get("told", []))

"""``optimizer_recreated``: the loop builds a new optimizer at every step, so its state never builds up (the ``lr``
probe's table ``diag/[<c>/]opt/recreated``); ``optimizer_restepped``: the loop steps an optimizer twice on the same
gradients (its table ``diag/[<c>/]opt/restepped``)."""
from __future__ import annotations

from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer

#: what a fresh optimizer of each class starts without, and what that does to its steps
LOST = {
    "Adam": "its moment estimates start from zero each time, so every weight moves by about the learning rate "
            "whatever its gradient (sign descent: no adaptive step sizes, no momentum)",
    "SGD": "its momentum buffer starts from zero each time: plain SGD, without the momentum you configured",
    "RMSprop": "its running average of squared gradients starts from zero each time, so every weight moves by "
               "about lr / sqrt(1 - alpha) whatever its gradient",
}
LOST["AdamW"] = LOST["NAdam"] = LOST["RAdam"] = LOST["Adamax"] = LOST["Adam"]


class _Streak(OncePer):
    """Reads the ``lr`` probe's table ``diag/[<c>/]<suffix>`` per component and hands on, once per component, each
    table whose ``steps`` reached ``patience`` (and that :meth:`counts`)."""

    suffix = ""

    def __init__(self, *, patience: int = 3, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience = patience

    def counts(self, table: dict[str, float]) -> bool:
        return True

    def due(self, record: Record, components: Sequence[Component]) -> list[tuple[Component, dict[str, float]]]:
        out = []
        for comp in components:
            table = record.tables.get(comp.key(self.suffix))
            if table and table["steps"] >= self.patience and self.counts(table) and self.first(comp.name):
                out.append((comp, table))
        return out


class OptimizerRecreated(_Streak):
    """Fires when a new optimizer of the same class over the same parameters took the previous one's place at
    ``patience`` (3) optimizer steps in a row, and a replaced one held state a fresh one starts without (Adam's
    moment estimates, SGD's momentum buffer): the optimizer is constructed inside the training loop. Training goes on
    (Adam degenerates into sign descent at the learning rate, momentum SGD into plain SGD) and a scheduler built on
    the first optimizer no longer changes the rate. Silent for optimizers that keep no state (plain SGD), for one
    rebuilt per stage or per epoch (a streak of 1), and for two optimizers kept and alternated. ``step``: where the
    streak began; ``persistent`` (a warning). Once per component."""

    kind = "optimizer_recreated"
    hint = ("Create the optimizer once, before the training loop (and any scheduler on it); change its learning rate "
            "through a scheduler or param_group['lr'] instead of building a new one. A new optimizer per stage "
            "(fine-tuning, unfreezing) is fine: build it when the stage begins, not inside the batch loop.")

    suffix = "opt/recreated"

    def counts(self, table: dict[str, float]) -> bool:
        return bool(table["stateful"])

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp, table in self.due(record, components):
            kind = comp.recreations.kind or "optimizer"
            since, steps = int(table["since"]), int(table["steps"])
            whose = f"of component {comp.name!r} " if comp.name else ""
            lost = LOST.get(kind, "the state it keeps between steps starts from zero each time")
            msg = (f"a new {kind} {whose}over the same parameters took the last one's place at each of {steps} "
                   f"optimizer steps in a row, from step {since}: the optimizer is built inside the training loop. "
                   f"Training goes on, but {lost}; a learning-rate scheduler built on the first one no longer acts.")
            out.append(self.make(since, msg, float(steps), float(self.patience), comp.key("opt/recreated"),
                                 ["persistent"]))
        return out


class OptimizerRestepped(_Streak):
    """Fires when, of a component's last 10 optimizer steps, at least ``patience`` (3) found the gradients of the same
    optimizer's step before: no backward pass since, the gradient tensors unchanged (``optimizer.step()`` called twice
    per iteration: in a helper and in the loop, ``scaler.step(opt)`` followed by ``opt.step()``). Each gradient is
    applied twice: the learning rate is doubled in effect, momentum and Adam's moments count it twice, and a schedule
    tuned for one step per batch runs at twice its pace. A closure step (L-BFGS) refreshes its gradients inside and is
    not counted; gradients assigned by hand each step (DP-SGD) are new tensors. ``step``: the first repeat of the span;
    ``persistent`` (a warning). Once per component."""

    kind = "optimizer_restepped"
    hint = ("Call optimizer.step() once per backward pass: look for a second call (a train_step helper that steps and a "
            "loop that steps again, scaler.step(optimizer) followed by optimizer.step(), a callback or a framework that "
            "already steps for you).")

    suffix = "opt/restepped"

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp, table in self.due(record, components):
            kind = comp.resteps.kind or "optimizer"
            whose = f" of component {comp.name!r}" if comp.name else ""
            msg = (f"{kind}.step(){whose} ran again on the gradients of its previous step, with no backward pass between, "
                   f"at {int(table['steps'])} of the last 10 optimizer steps (first at step {int(table['since'])}): each "
                   f"gradient is applied twice, so the learning rate is doubled in effect and the optimizer's moments "
                   f"count each gradient twice.")
            out.append(self.make(int(table["since"]), msg, table["steps"], float(self.patience), comp.key("opt/restepped"),
                                 ["persistent"]))
        return out

"""``preflight``: the sanity pre-flight's alerts (see :mod:`trackdiag.forensics.preflight`).

This rule judges no record: it carries the options, the action and the cooldown of the alerts that
``Diagnostics.preflight()`` emits, and ``auto`` (run the pre-flight on the first ``step()``'s batch)."""
from __future__ import annotations

from typing import Any

from trackdiag.core.registry import resolve
from trackdiag.rules.base import Rule


class Preflight(Rule):
    """Options: ``auto`` run at the first step (``extreme``); ``overfit_steps`` (30) and
    ``overfit_drop`` (0.1: the loss must fall by 10%) of the overfit-one-batch check; ``loss_fn``
    (callable or dotted path, ``fn(outputs, batch) -> loss``) for the automatic run."""

    kind = "preflight"
    hint = ("Fix the set-up before training: model.train(), one device for model and data, pass every "
            "trainable parameter to the optimizer, remove .detach()/.data/no_grad from the loss path, check labels and loss.")

    def __init__(self, *, auto: bool = False, overfit_steps: int = 30, overfit_drop: float = 0.1, loss_fn: Any = None,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.auto, self.overfit_steps, self.overfit_drop = auto, overfit_steps, overfit_drop
        self.loss_fn = resolve(loss_fn) if isinstance(loss_fn, str) else loss_fn

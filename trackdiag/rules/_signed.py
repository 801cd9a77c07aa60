"""A *signed* loss: one that has taken negative values. A minimised loss is usually a non-negative error; a
policy-gradient or actor-critic loss (``-log_prob * advantage`` summed over an episode) is signed, and its sum
grows as episodes lengthen, its gradient norm with it. The loss rules record such a rise and name
``objective="rl"`` in its hint (see :class:`trackdiag.rules.loss.LossSpike`). No measurement of its own.
"""
from __future__ import annotations

import dataclasses

from trackdiag.core.alert import Alert

RL_HINT = ('A signed loss that grows with its gradient norm, the weights steady: a policy-gradient or actor-critic loss '
           'summed over episodes grows as they lengthen. If this is RL, pass objective="rl" (Hydra: diag.objective=rl); '
           'otherwise lower the learning rate, clip gradients, inspect this step\'s batch.')


def signed_rise(alert: Alert, first_negative: int) -> Alert:
    """``alert`` about a loss that has been negative (at step ``first_negative``, -1: never) with the hint naming
    ``objective="rl"``: a loss that takes negative values is not the non-negative error a minimised loss usually is,
    and a policy-gradient loss is the common one. Unchanged when the loss was never negative."""
    if first_negative < 0:
        return alert
    return dataclasses.replace(alert, hint=RL_HINT)

"""The every-step loss rules judge a series the same whatever the windows it arrives in: a run logged every 10 steps,
every 5 or every step (an anomaly window) gives the same findings at the same steps, and every cadence (every 50, a
ragged one) leaves the same state. (A rule reports at most one finding per series and window: two findings of one
series in one window of 50, an early rise and then a late divergence, report the second at the next window.)

``loss_divergence`` and ``loss_runaway`` keep their per-series state in locals while they scan a window and write it
back once (the logging step's longest host loops at ``basic``); a value forgotten between two windows would show here
as a finding that moves or disappears when the window is cut differently."""
from __future__ import annotations

import math
import random

import pytest

from trackdiag.core.record import Record
from trackdiag.rules.loss import LossDivergence
from trackdiag.rules.runaway import LossRunaway


def _series(kind: str, n: int, rng: random.Random) -> list[float]:
    """Loss shapes that exercise every branch: a healthy fall, a rise from the start, a late divergence, a sparse
    (mostly exactly 0) mined loss, a runaway below zero, non-finite values in the middle."""
    out = []
    for i in range(n):
        noise = 1 + 0.1 * (rng.random() - 0.5)
        if kind == "fall":
            v = (2.0 * math.exp(-i / 60) + 0.1) * noise
        elif kind == "early_rise":
            v = (1.0 + 0.2 * i) * noise
        elif kind == "late":
            v = (2.0 * math.exp(-i / 30) + 0.1) * noise if i < 120 else (0.1 + 0.05 * (i - 120)) * noise
        elif kind == "sparse":
            v = 0.0 if rng.random() < 0.6 else (1.0 + (i > 150) * 3.0) * noise
        elif kind == "runaway":
            v = 5.0 * noise if i < 40 else -0.5 * (i - 40) ** 2 * noise
        else:  # "nonfinite"
            v = math.nan if i in (37, 38, 90) else (math.inf if i == 140 else (1.5 - i / 400) * noise)
        out.append(v)
    return out


def _judge(rule_cls: type, values: list[float], cuts: list[int]) -> tuple[list[tuple], dict]:
    """Feed ``values`` to a fresh rule in windows ending before each of ``cuts``: its findings and its state."""
    rule = rule_cls()
    found, start = [], 0
    for end in [*cuts, len(values)]:
        if end <= start:
            continue
        rec = Record(step=end - 1, time=0.0)
        rec.series["diag/loss"] = [(s, values[s]) for s in range(start, end)]
        found += [(a.kind, a.step, a.severity, a.message, a.value, a.threshold) for a in rule.check(rec, [], [])]
        start = end
    state = {k: v for k, v in vars(rule).items() if k.startswith("_") and k not in ("_loss", "_grad")}
    return found, state


@pytest.mark.parametrize("rule_cls", [LossDivergence, LossRunaway])
@pytest.mark.parametrize("kind", ["fall", "early_rise", "late", "sparse", "runaway", "nonfinite"])
def test_findings_and_state_do_not_depend_on_the_logging_cadence(rule_cls: type, kind: str) -> None:
    values = _series(kind, 300, random.Random(kind))
    if rule_cls is LossRunaway:  # a window longer than the points a series keeps (every=2000) is taken point by point
        long = _series(kind, 1100, random.Random(kind))
        assert _judge(rule_cls, long, [])[0] == _judge(rule_cls, long, list(range(1, 1100)))[0]
    every_step = _judge(rule_cls, values, list(range(1, 300)))
    for cuts in (range(5, 300, 5), range(10, 300, 10)):
        assert _judge(rule_cls, values, list(cuts)) == every_step
    for cuts in (range(50, 300, 50), sorted(random.Random(1).sample(range(1, 300), 17))):
        assert _judge(rule_cls, values, list(cuts))[1] == every_step[1]
    if kind in ("early_rise", "late") and rule_cls is LossDivergence or kind == "runaway" and rule_cls is LossRunaway:
        assert every_step[0], f"{rule_cls.kind} found nothing on a {kind!r} series: the test exercises no finding"

"""The alert policy: one place that turns a rule's evidence into a severity.

A rule reports a *finding*: what crossed which line, by how much, since when, and with what
evidence that something is wrong for training. The policy, not the rule, decides how loud it is:

==================  =======================================================================
evidence            meaning
==================  =======================================================================
``persistent``      the condition held over several measurements or a span of steps
``loss``            the loss shows it: it reacted (spiked, rose, went non-finite) or sits where a
                    correctly wired model of this task would not (far above chance at the start)
``weights``         the weights show it: update-to-weight ratios or parameter norms moved with it
``corroborated``    an independent signal agrees (a gradient spike and a loss spike at one step)
``unambiguous``     a value no healthy run produces: NaN/Inf, an update larger than the weights it
                    changes, gradients reused or wiped, labels outside the classes, a crash
==================  =======================================================================

Severity = ``critical`` with ``unambiguous`` or with two of the others, ``warning`` with one of
them, ``info`` with none: a statistic crossing a line is a recorded finding, never an alarm on its
own. A user may pin a rule's severity (``rules.<kind>.severity``); that wins over the policy.
"""
from __future__ import annotations

from typing import Iterable

SEVERITIES = ("info", "warning", "critical")
EVIDENCE = ("persistent", "loss", "weights", "corroborated", "unambiguous")
_DOUBLE = frozenset({"unambiguous"})


def severity(evidence: Iterable[str]) -> str:
    """The severity the policy gives a finding with ``evidence`` (see module docstring)."""
    ev = set(evidence)
    unknown = ev.difference(EVIDENCE)
    if unknown:
        raise ValueError(f"unknown evidence {sorted(unknown)}; known: {', '.join(EVIDENCE)}")
    score = sum(2 if e in _DOUBLE else 1 for e in ev)
    return SEVERITIES[min(score, 2)]


def rank(level: str) -> int:
    """``info`` < ``warning`` < ``critical`` as 0, 1, 2."""
    return SEVERITIES.index(level)


def describe(evidence: Iterable[str]) -> str:
    """The evidence as words for an alert's text: ``"persistent, loss reacts"``."""
    words = {"persistent": "persistent", "loss": "the loss shows it", "weights": "the weights show it",
             "corroborated": "corroborated", "unambiguous": "unambiguous"}
    return ", ".join(words[e] for e in EVIDENCE if e in set(evidence))

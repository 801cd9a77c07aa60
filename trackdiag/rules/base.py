"""The :class:`Rule` contract: a judge of records that emits :class:`Alert` objects."""
from __future__ import annotations

import math
import weakref
from typing import Any, ClassVar, Sequence

from trackdiag.alerts.objectives import Objectives
from trackdiag.capture.context import Component
from trackdiag.core import policy
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record


class Rule:
    """Turns each logging step's record into findings: what crossed which line, since when, and the
    evidence that it matters for training (:mod:`trackdiag.core.policy` turns the evidence into the
    severity; the rule never picks it).

    ``check`` sees the new record, the recent history (oldest first) and the components; it
    returns the findings as :class:`Alert` objects (the session folds repeats into incidents and
    applies actions). Rules may keep small host-side state (EMAs, streaks) and expose it through
    ``state_dict``.

    Args:
        enabled: switch the rule off.
        action: what the session does when it fires: ``log`` | ``warn`` | ``stop`` | ``raise``
            (``stop``/``raise`` act on findings of warning or worse).
        cooldown: steps without a new finding after which an incident counts as over: a finding
            of the same kind and place within them is folded into the open incident.
        severity: pin the severity (``info`` | ``warning`` | ``critical``) instead of the policy's.
    """

    kind: ClassVar[str] = ""
    hint: ClassVar[str] = ""
    def __init__(self, *, enabled: bool = True, action: str = "warn", cooldown: int = 100, severity: str | None = None) -> None:
        self.enabled = enabled
        self.action = action
        self.cooldown = cooldown
        self.pinned = severity
        self.objectives = Objectives("minimize")  # the session's, shared by every rule
        #: a finding waits for the next steps to be judged: the session logs every step up to this one
        self.follow_until = -1

    def minimised(self, component: str) -> bool:
        """Whether the loss of ``component`` (``""``: the model) is an objective that should fall."""
        return self.objectives.minimised(component)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        """Alerts for ``record``. Default: none."""
        return []

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        """Alerts for an evaluation record from ``log_eval``. Default: none."""
        return []

    def at_close(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        """Findings still pending when the run ends (judged on what there is). Default: none."""
        return []

    def make(self, step: int, message: str, value: float = math.nan, threshold: float = math.nan, where: str = "",
             evidence: Sequence[str] = ()) -> Alert:
        """A finding at ``step``; its severity is the policy's verdict on ``evidence`` (unless pinned)."""
        ev = tuple(e for e in policy.EVIDENCE if e in set(evidence))
        level = self.pinned or policy.severity(ev)
        return Alert(self.kind, int(step), level, message, float(value), float(threshold), where, self.hint, ev,
                     1, int(step))

    def incident_key(self, alert: Alert) -> str:
        """What makes two findings of this rule the same incident: by default their ``where``."""
        return alert.where

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``."""


def phase_start(record: Record) -> int:
    """The step a new training phase began at within ``record``'s window (an optimizer stepping for
    the first time, parameters joining training: see :mod:`trackdiag.session.steps`), or -1. Rules
    that judge a series against its own history start that history again there."""
    return int(record.tables.get("diag/phase", {}).get("start", -1))


def loss_series(record: Record) -> dict[str, list[tuple[int, float]]]:
    """The per-step loss series of a record: ``{key: [(step, value), ...]}``."""
    return {k: v for k, v in record.series.items() if k.endswith("/loss") or k == "diag/loss"}


def where_of(key: str) -> str:
    """The component a loss key belongs to: ``diag/G/loss`` -> ``G``; ``diag/loss`` -> ``""``."""
    parts = key.split("/")
    return parts[1] if len(parts) == 3 else ""


def loss_where(key: str) -> str:
    """The ``where`` of an alert about a loss series: the series' metric key (``diag/loss``,
    ``diag/G/loss``), so the alert names the chart to look at."""
    return key


#: a learning rate under this share of its peak moves no weight (``lr_vanished``; ``stale_params`` and ``eval_frozen``
#: read it too)
VANISHED_LR = 1e-4


#: a model input whose largest magnitude over a window (``diag/data/input_absmax``) is under this is named in the
#: messages of a model at chance (``not_learning``, ``mode_collapse``): pixels divided by 255 twice stay under 0.004.
#: Never a finding on its own: audio and some features are small by nature
TINY_INPUT = 0.01


def learning_rates(record: Record, comp: Component) -> dict[str, float]:
    """``comp``'s learning rates in ``record`` (the ``lr`` probe's keys): ``diag/[<c>/]opt/lr``, or one per param group
    under it."""
    base = comp.key("opt/lr")
    return {k: v for k, v in record.scalars.items() if k == base or k.startswith(base + "/")}


def layer_values(record: Record, prefix: str) -> dict[str, float]:
    """Per-layer values under ``prefix`` (``diag/grad/norm``): the full table when the keys were
    coarsened, else the per-layer scalar keys."""
    table = record.tables.get(prefix)
    if table is not None:
        return table
    return dict(_by_prefix(record).get(prefix, ()))


_prefixes: tuple[Any, int, dict[str, list[tuple[str, float]]]] | None = None  # (record ref, scalars seen, index)


def _by_prefix(record: Record) -> dict[str, list[tuple[str, float]]]:
    """The record's scalars under every key prefix (``diag/grad/norm`` -> ``[("fc1", 0.3), ...]``), built once
    per record (the rules ask for a dozen prefixes per logging step; scanning every key each time cost ~40k
    string tests per 100 records)."""
    global _prefixes
    got = _prefixes
    if got is not None and got[0]() is record and got[1] == len(record.scalars):
        return got[2]
    index: dict[str, list[tuple[str, float]]] = {}
    for k, v in record.scalars.items():
        at = k.find("/")
        while at >= 0:
            index.setdefault(k[:at], []).append((k[at + 1:], v))
            at = k.find("/", at + 1)
    _prefixes = (weakref.ref(record), len(record.scalars), index)
    return index


def points_of(record: Record, key: str) -> list[tuple[int, float]]:
    """Every ``(step, value)`` of ``key`` in ``record``: its every-step series when it has one,
    else the scalar at the record's step, else nothing."""
    pts = record.series.get(key)
    if pts is not None:
        return pts
    v = record.scalars.get(key)
    return [(record.step, v)] if v is not None else []


def latest(record: Record, key: str) -> float | None:
    """The last value of ``key`` in ``record`` (series or scalar), or None."""
    pts = points_of(record, key)
    return pts[-1][1] if pts else None


class OncePer(Rule):
    """A rule that reports each key (a component, a layer) once per run: :meth:`first` says whether ``key`` is new
    and marks it; the keys reported travel in the rule's state (a resumed run does not report them again)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._fired: set[str] = set()

    def first(self, key: str) -> bool:
        """True the first time ``key`` is reported (and marks it), False after."""
        if key in self._fired:
            return False
        self._fired.add(key)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = set(state.get("fired", []))

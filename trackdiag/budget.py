"""The cost budget: trackdiag keeps its own time within the share of the step its preset publishes.

A preset's fixed costs (hooks, the NaN replay's capture, a logging step every ``every`` steps) are small
next to a step of 10 ms or more, and not next to one of 1-5 ms (one sentence per step, a tiny MLP). The
session measures its own time against the wall time of each logging window (the end-of-run summary's
figure); once the run is past its first ``WARMUP`` steps (where setup faults show and not_learning judges), when the
median of the last ``WINDOWS`` windows, scaled by ``WALL`` (own time undercounts the wall cost: the
allocator, caches and the cyclic GC pay for what trackdiag holds; measured by benchmarks/overhead.py), is
above the budget, the session sheds one thing, in this order, and measures again:

  1. ``extras`` (``extreme`` only): the per-module output flags and the exact-step NaN replay's host read
     per step: the NaN replay runs at the logging step, as at ``advanced``, from a weight snapshot;
  2. ``every x2``, then ``every x5``: the logging step (collect, one host copy, rules, sinks) every 2x, then
     5x, the preset's cadence. The every-step series (loss, pre-clip gradient norm) still hold every step,
     and at the preset's own cadence one host read of the window's losses and gradient norms asks for a
     logging step at a NaN/Inf or a jump (:meth:`~trackdiag.session_budget.CostBudget._window_check`): those
     are logged, replayed and raised as before. A per-layer finding waits for the next logging step.

Nothing is shed back (a run whose steps grow heavier keeps the lighter cadence). Every shed is logged
once (INFO), kept in ``summary()["budget"]`` and printed in the end-of-run summary. ``diag.budget``:
``auto`` (the preset's published figure: :data:`SHARES`), a share (``0.05``: 5 %), or ``null`` to keep
the preset's cadence whatever it costs.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

#: the published cost of each preset (README, docs/performance.md): the upper end, as a share of the step
SHARES = {"basic": 0.06, "advanced": 0.09, "extreme": 0.12}
WARMUP = 300   # steps before the first decision: a run's start (setup faults, not_learning's first verdicts) at full cadence
WINDOWS = 5    # logging windows judged together (their median: a histogram step or a GC pause is one window)
WALL = 1.25    # wall cost / own time on short-step loops (seq2seq: 0.116 / 0.092 advanced, 0.204 / 0.151 extreme)
STRIDES = (2, 5)


def share_of(setting: object, level: str) -> float | None:
    """The budget a ``diag.budget`` setting means: None when off (``null``/``false``), a preset's published
    share for ``auto`` (a custom preset: ``advanced``'s), else the number."""
    if setting is None or setting is False:
        return None
    if setting == "auto":
        return SHARES.get(level, SHARES["advanced"])
    return float(setting)  # type: ignore[arg-type]


def budget_problems(value: object) -> list[str]:
    """Problems of ``diag.budget``: ``auto``, ``null``/``false``, or a share in (0, 1]."""
    if value is None or value is False or value == "auto":
        return []
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return []
    return [f"diag.budget: {value!r} is not 'auto', null (no budget) or a share of the step in (0, 1] (0.09: 9 %)"]


@dataclass
class Budget:
    """Decides, window by window, whether to shed the next thing of ``sheds`` (see the module docstring)."""

    share: float
    sheds: list[str]
    warmup: int = WARMUP
    windows: int = WINDOWS
    ratios: collections.deque[float] = field(init=False)
    taken: list[dict[str, object]] = field(default_factory=list)  # {step, shed, measured}
    last: float = float("nan")  # the latest judged estimate (wall share)

    def __post_init__(self) -> None:
        self.ratios = collections.deque(maxlen=self.windows)

    def window(self, step: int, own: float, wall: float) -> str | None:
        """One logging window: ``own`` seconds of trackdiag's time in ``wall`` seconds of the loop's. Returns
        the shed to apply now, or None."""
        if own <= 0 or wall <= own:
            return None
        self.ratios.append(own / (wall - own))
        if step < self.warmup or len(self.ratios) < self.windows:
            return None
        self.last = WALL * statistics.median(self.ratios)
        if not self.sheds or self.last <= self.share:
            return None
        shed = self.sheds.pop(0)
        self.ratios.clear()  # measured again, from the next window on
        self.taken.append({"step": step, "shed": shed, "measured": round(self.last, 4)})
        return shed

    def over(self) -> bool:
        """Still above the budget with nothing left to shed (the summary says what to do)."""
        return not self.sheds and self.last == self.last and self.last > self.share

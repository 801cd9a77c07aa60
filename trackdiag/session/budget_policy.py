"""The cost budget: trackdiag keeps its own time within the share of the step its preset publishes.

A preset's fixed costs (hooks, the NaN replay's capture, a logging step every ``every`` steps) are small
next to a step of 10 ms or more, and not next to one of 1-5 ms (one sentence per step, a tiny MLP). The
session measures its own time against the wall time of each logging window (the end-of-run summary's
figure); once the run is past its first ``WARMUP`` steps (where setup faults show and not_learning judges), when the
median of the last ``WINDOWS`` windows is above the budget, the session sheds one thing, in this order, and
measures again. The per-step part of the own time (hooks and ``step()`` outside the logging step) is scaled by
``WALL``: trackdiag's Python between the user's operations of every step costs the loop more than its own clock
shows (caches, the allocator, the cyclic GC; measured by benchmarks/overhead.py: wall/own 1.3-1.5 on a
one-sentence-per-step seq2seq, ~1.0 on a 30 ms MLP whose own time is mostly its logging step).

  1. ``extras`` (``extreme`` only): the per-module output flags and the exact-step NaN replay's host read
     per step: the NaN replay runs at the logging step, as at ``advanced``, from a weight snapshot. Only when
     the own time alone (not scaled by ``WALL``) is above the budget: at the first decision, else never;
  2. ``every x2``, then ``every x5``: the logging step (collect, one host copy, rules, sinks) every 2x, then
     5x, the preset's cadence. The every-step series (loss, pre-clip gradient norm) still hold every step,
     and at the preset's own cadence one host read of the window's losses and gradient norms asks for a
     logging step at a NaN/Inf or a jump (:meth:`~trackdiag.session.budget.CostBudget._window_check`): those
     are logged, replayed and raised as before. A per-layer finding waits for the next logging step;
  3. ``capture`` (``advanced`` and ``extreme``): the NaN replay's per-call capture of the training forwards
     (a call slot on each root model, the arguments kept for the ring's steps). A NaN step that gave
     ``step(batch=...)`` is still replayed from it (the user's loss, else ``model(inputs)``) and named; one
     without a batch is raised at its step, without its module, and the alert says why.

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
WALL = 1.5     # wall cost / own time of the per-step part (seq2seq: the whole own time 1.07-1.49 by preset and run)
STRIDES = (2, 5)
PER_STEP = ("extras", "capture")  # the sheds that lighten every step; the others only the logging step


def share_of(setting: object, level: str) -> float | None:
    """The budget a ``diag.budget`` setting means: None when off (``null``/``false``), a preset's published
    share for ``auto`` (a custom preset: ``advanced``'s), else the number."""
    if setting is None or setting is False:
        return None
    if setting == "auto":
        return SHARES.get(level, SHARES["advanced"])
    return float(setting)  # type: ignore[arg-type]


@dataclass
class Budget:
    """Decides, window by window, whether to shed the next thing of ``sheds`` (see the module docstring)."""

    share: float
    sheds: list[str]
    warmup: int = WARMUP
    windows: int = WINDOWS
    ratios: collections.deque[float] = field(init=False)
    measured: collections.deque[float] = field(init=False)  # the same windows, own time as the clock has it
    taken: list[dict[str, object]] = field(default_factory=list)  # {step, shed, measured}
    last: float = float("nan")  # the latest judged estimate (wall share)
    floors: collections.deque[float] = field(init=False)  # the same windows, the per-step part alone (x WALL)
    cannot: dict[str, float] | None = None  # set once: the per-step part alone is above the budget ({step, floor})

    def __post_init__(self) -> None:
        self.ratios = collections.deque(maxlen=self.windows)
        self.measured = collections.deque(maxlen=self.windows)
        self.floors = collections.deque(maxlen=self.windows)

    def window(self, step: int, own: float, wall: float, logging: float = 0.0) -> str | None:
        """One logging window: ``own`` seconds of trackdiag's time in ``wall`` seconds of the loop's, ``logging`` of
        them in the logging step (its collect, host copy, rules and sinks: paid once, not between the user's
        operations of every step, so not scaled by ``WALL``). Returns the shed to apply now, or None."""
        if own <= 0 or wall <= own:
            return None
        logging = min(max(logging, 0.0), own)
        self.ratios.append((WALL * (own - logging) + logging) / (wall - own))
        self.measured.append(own / (wall - own))
        self.floors.append(WALL * (own - logging) / (wall - own))
        if step < self.warmup or len(self.ratios) < self.windows:
            return None
        self.last = statistics.median(self.ratios)
        if self.sheds and self.sheds[0] == "extras" and statistics.median(self.measured) <= self.share:
            self.sheds.pop(0)  # a capability, not a cadence: shed only on the clock's own evidence, never on WALL's
        floor = statistics.median(self.floors)
        if self.cannot is None and floor > self.share and not any(s in PER_STEP for s in self.sheds):
            self.cannot = {"step": float(step), "floor": round(floor, 4)}  # no cadence can bring it under: say so now
        if not self.sheds or self.last <= self.share:
            return None
        shed = self.sheds.pop(0)
        self.ratios.clear()  # measured again, from the next window on
        self.measured.clear()
        self.floors.clear()
        self.taken.append({"step": step, "shed": shed, "measured": round(self.last, 4)})
        return shed

    def over(self) -> bool:
        """Still above the budget with nothing left to shed (the summary says what to do)."""
        return not self.sheds and self.last == self.last and self.last > self.share

"""``lr_vanished``: a learning rate that fell to almost nothing early and stayed there; ``lr_negative``: a learning rate
below 0, a schedule run past its end (keys of the ``lr`` probe)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import VANISHED_LR, Rule, learning_rates, phase_start


def series_name(comp: Component, key: str, base: str) -> str:
    """A learning-rate series in words: its component and param group (``key`` under ``base``), or "the optimizer"."""
    group = key[len(base) + 1:]
    return " ".join(filter(None, [f"component {comp.name!r}" if comp.name else "",
                                  f"param group {group!r}" if group else ""])) or "the optimizer"


@dataclass
class _Track:
    """One learning-rate series (an optimizer's, or one param group's) within the current phase."""

    first: int  # the step it was first seen at (in this phase)
    peak: float = 0.0
    tenth: int = -1  # the first step of the current stretch at or below a tenth of the peak (-1: above)
    low: int = -1  # the first step of the current stretch below ``ratio`` x the peak (-1: not)
    fired: bool = False


class LrVanished(Rule):
    """Fires when a learning rate (each optimizer's, each param group's) fell below ``ratio`` (1e-4) of its peak
    within ``fall_steps`` (1,000) steps of first being under a tenth of it, stays above 0 (an LR set to exactly 0 is
    a deliberate freeze, judged by ``stale_params``) and has stayed that low for at least ``min_steps`` (20) steps and
    ``share`` (25 %) of the phase so far. The classic cause: a scheduler meant per epoch (``StepLR``,
    ``MultiStepLR``, ``ExponentialLR``) stepped every batch: ``StepLR(step_size=30, gamma=0.1)`` takes the rate
    10,000x down in 120 batches, and the run goes on with weights that an update of ``lr x gradient`` no longer moves.

    Silent by construction for schedules that end near 0 (cosine or linear decay to 0, ``OneCycleLR``: below 1e-4 of
    the peak for the last ~0.5 % of the run), warm-up from 0 (each new rate is the peak), warm restarts, a plateau
    scheduler's cuts down to its ``min_lr`` or spread over more than ``fall_steps``, and a new training phase (a new
    optimizer: judged against its own peak). A plateau scheduler without ``min_lr`` that cuts the rate 10,000x within
    ``fall_steps`` and leaves the run there is raised too: the run is as frozen. ``step``: where the rate went below
    the ratio; ``persistent`` (a warning). Once per series."""

    kind = "lr_vanished"
    hint = ("Step an epoch-based scheduler (StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR with T_max in epochs) "
            "once per epoch, after the epoch's batches, or give it its periods in optimizer steps (step_size=30 * "
            "len(train_loader)); per-batch schedules (OneCycleLR, the Hugging Face warm-up schedules) take the total "
            "number of optimizer steps; ReduceLROnPlateau takes a min_lr. A rate meant to reach ~0 this early: "
            "diag.rules.lr_vanished.enabled=false.")

    def __init__(self, *, ratio: float = VANISHED_LR, fall_steps: int = 1000, min_steps: int = 20, share: float = 0.25,
                 **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio, self.fall_steps, self.min_steps, self.share = ratio, fall_steps, min_steps, share
        self._tracks: dict[str, _Track] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        if phase_start(record) >= 0:  # a new phase (an optimizer's first step): each series starts over
            self._tracks = {k: t for k, t in self._tracks.items() if t.fired}
        out = []
        for comp in components:
            base = comp.key("opt/lr")
            for key, lr in learning_rates(record, comp).items():
                alert = self._judge(comp, key, base, float(lr), record.step)
                if alert is not None:
                    out.append(alert)
        return out

    def _judge(self, comp: Component, key: str, base: str, lr: float, step: int) -> Alert | None:
        t = self._tracks.get(key)
        if t is None:
            t = self._tracks[key] = _Track(first=step)
        if t.fired or lr != lr:  # NaN: another rule's business
            return None
        if lr >= t.peak:
            t.peak, t.tenth, t.low = lr, -1, -1
            return None
        if lr > 0.1 * t.peak:
            t.tenth, t.low = -1, -1
            return None
        if t.tenth < 0:
            t.tenth = step
        if not 0.0 < lr < self.ratio * t.peak:
            t.low = -1
            return None
        if t.low < 0:
            t.low = step
        stayed = step - t.low
        if t.low - t.tenth > self.fall_steps or stayed < self.min_steps or stayed < self.share * (step - t.first):
            return None
        t.fired = True
        where = series_name(comp, key, base)
        msg = (f"the learning rate of {where} went from its peak {t.peak:.3g} to under {self.ratio:g} of it at step "
               f"{t.low}, {t.low - t.tenth} steps after dropping under a tenth of it, and has stayed there ({stayed} steps, "
               f"{100 * stayed / max(step - t.first, 1):.0f} % of the run; now {lr:.2g}): the weights barely move. A "
               f"scheduler meant per epoch, stepped every batch, does this (or a plateau scheduler without a min_lr).")
        return self.make(t.low, msg, lr / t.peak, self.ratio, key, ["persistent"])

    def state_dict(self) -> dict[str, Any]:
        return {k: [t.first, t.peak, t.tenth, t.low, t.fired] for k, t in self._tracks.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._tracks = {k: _Track(int(a), float(b), int(c), int(d), bool(e)) for k, (a, b, c, d, e) in state.items()}


class LrNegative(Rule):
    """Fires at the first logging step where a learning rate (an optimizer's, a param group's) is below 0: the optimizer
    then climbs the loss. PyTorch's optimizers refuse a negative rate when built, so one that turns up during training
    comes from a schedule run past its end: a hand-written linear decay (``LambdaLR(opt, lambda s: 1 - s / total)``)
    stepped more than ``total`` times (more epochs than planned, ``total`` counted in epochs but stepped per batch,
    gradient accumulation miscounted). ``step``: that logging step (the last one with the rate at or above 0 is named);
    ``unambiguous`` (critical). Once per series."""

    kind = "lr_negative"
    hint = ("Clamp the schedule's factor at 0 (LambdaLR(opt, lambda s: max(0.0, 1 - s / total))), give the scheduler "
            "the real number of optimizer steps (epochs x len(loader) / accumulation steps), or stop stepping it when "
            "training runs past the planned length. Hugging Face's get_linear_schedule_with_warmup clamps at 0.")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._last: dict[str, tuple[int, float]] = {}  # per series: the last logging step with a rate >= 0, and that rate
        self._fired: set[str] = set()

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            base = comp.key("opt/lr")
            for key, lr in learning_rates(record, comp).items():
                lr = float(lr)
                if not lr < 0.0:  # NaN is another rule's business
                    if lr == lr:
                        self._last[key] = (record.step, lr)
                    continue
                if key in self._fired:
                    continue
                self._fired.add(key)
                where = series_name(comp, key, base)
                before = self._last.get(key)
                was = f" (it was {before[1]:.3g} at step {before[0]})" if before is not None else ""
                msg = (f"the learning rate of {where} is {lr:.3g} at step {record.step}, below 0{was}: the optimizer "
                       f"climbs the loss instead of descending it. A schedule run past its end does this (a linear decay "
                       f"1 - step / total stepped more than total times).")
                out.append(self.make(record.step, msg, lr, 0.0, key, ["unambiguous"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"last": {k: list(v) for k, v in self._last.items()}, "fired": sorted(self._fired)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last = {k: (int(a), float(b)) for k, (a, b) in state.get("last", {}).items()}
        self._fired = set(state.get("fired", []))

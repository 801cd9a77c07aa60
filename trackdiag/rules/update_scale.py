"""``update_scale``: the optimizer's steps jumped out of scale while the gradient looks ordinary."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule, latest, phase_start


class UpdateScale(Rule):
    """The whole model's step (``update/step_size``: ||dw|| / ||w|| over the parameters not born zero) at a
    measurement is ``jump`` (10) x or more above the largest of this phase's earlier measurements (at least
    ``history`` (5) of them), or ``WITH_LR`` (3) x above their median where the learning rate also jumped ``jump`` x or more
    between two logging steps since the previous measurement, beyond what a warm-up from 0 gives between them (the rate
    growing with the step or its square: ``((s + 1) / (s_before + 1))**2``; Noam's linear ramp is x11 from step 0 to
    step 10) (the weights a blown-up rate inflates shrink the ratio
    within steps; a warm-up ramps the rate over many logging steps: accelerate_cv's 15x from step 9 to 50 is no jump; nor
    is a rise back to no more than ``REVISIT`` (1.5) x the largest rate of the run so far, as a warm restart's: SGDR's
    cosine back to its base rate, 18x in one step), while the pre-clip gradient norm there is no more than ``GRAD_FACTOR`` (3) x its
    median over those measurements: the update, not the gradient, changed. Under Adam (which normalises the
    gradient) or clipping, a learning rate blown up shows nowhere else at first: the loss may only double and
    the gradient stays clipped to its usual size, while the weights are rewritten until units saturate.
    Evidence ``weights`` (warning); ``corroborated`` (critical) when the learning rate rose with it. A linear warm-up raises the step ~5x between the first ten steps and
    step 50, a warm restart back to its earlier size: neither is a jump. A new phase (``diag/phase``) starts the
    history again. ``step`` is the measurement; ``where`` the component. Host work on logging steps only."""

    kind = "update_scale"
    hint = ("Check the learning rate (a schedule or a manual change that multiplied it, a param group's lr, a "
            "scaled lr for a larger batch), a reset or replaced optimizer state, and a patched optimizer step. "
            "Adam and gradient clipping hide a learning rate blow-up from the gradient: the update carries it.")

    GRAD_FACTOR, WITH_LR, REVISIT = 3.0, 3.0, 1.5

    def __init__(self, *, jump: float = 10.0, history: int = 5, **kw: Any) -> None:
        super().__init__(**kw)
        self.jump, self.history = jump, history
        self._sizes: dict[str, list[float]] = {}  # component -> this phase's step sizes
        self._grads: dict[str, list[float]] = {}  # component -> the gradient norm at those measurements
        self._lr: dict[str, float] = {}  # component -> its largest learning rate at the previous logging step
        self._lr_step: dict[str, int] = {}  # component -> the step of that reading
        self._lr_top: dict[str, float] = {}  # component -> the largest learning rate of the run so far
        self._at: dict[str, float] = {}  # component -> its learning rate at the previous measurement
        self._rose: dict[str, float] = {}  # component -> the rate before a jump x10 between two logging steps, since the last measurement

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        if phase_start(record) >= 0:
            self._sizes.clear()
            self._grads.clear()
        for comp in components:
            lr = self._top_lr(record, comp)
            last = self._lr.get(comp.name, math.nan)
            top = self._lr_top.get(comp.name, math.nan)
            # what a warm-up from 0 gives between the two readings: a rate growing with the step (Noam's linear
            # ramp, x11 from step 0 to 10), or with its square, is no jump
            ramp = ((record.step + 1) / (self._lr_step.get(comp.name, record.step) + 1)) ** 2
            if last > 0 and lr >= self.jump * last * ramp and not lr <= self.REVISIT * top:
                self._rose.setdefault(comp.name, last)  # a jump between two logging steps, to a rate never used before
            if math.isfinite(lr):
                self._lr[comp.name], self._lr_step[comp.name] = lr, record.step
                self._lr_top[comp.name] = max(lr, top) if math.isfinite(top) else lr
            size = record.scalars.get(comp.key("update/step_size"))
            grad = latest(record, comp.key("grad/global_norm"))
            if size is None or grad is None or not (math.isfinite(size) and math.isfinite(grad)):
                continue
            sizes, grads = self._sizes.setdefault(comp.name, []), self._grads.setdefault(comp.name, [])
            before, jumped_from = (max(sizes) if sizes else math.nan), self._rose.pop(comp.name, math.nan)
            raised, prev_lr = jumped_from > 0, self._at.get(comp.name, math.nan)
            self._at[comp.name] = lr
            usual = statistics.median(sizes) if sizes else math.nan
            if (len(sizes) >= self.history and usual > 0 and grad <= self.GRAD_FACTOR * statistics.median(grads)
                    and (size >= self.jump * before or (raised and size >= self.WITH_LR * usual))):
                out.append(self._finding(record.step, comp, size, before, usual, grad, statistics.median(grads), lr,
                                         jumped_from if raised else prev_lr, raised))
                sizes.clear()  # judged against its new scale from here on: said once
                grads.clear()
            sizes.append(size)
            grads.append(grad)
        return out

    @staticmethod
    def _top_lr(record: Record, comp: Component) -> float:
        key = comp.key("opt/lr")
        lrs = [v for k, v in record.scalars.items() if (k == key or k.startswith(key + "/")) and math.isfinite(v)]
        return max(lrs) if lrs else math.nan

    def _finding(self, step: int, comp: Component, size: float, before: float, usual: float, grad: float, level: float,
                 lr: float, prev_lr: float, raised: bool) -> Alert:
        """The finding (see class doc) at measurement ``step``; ``prev_lr`` is the rate before the jump when it
        ``raised``, else the rate at the previous measurement."""
        why = (f"; the learning rate rose from {prev_lr:.3g} to {lr:.3g}" if raised else
               "; the learning rate did not change: a reset optimizer state or a patched step?" if lr == prev_lr else "")
        msg = (f"one optimizer step moved the weights by {size:.3g} of their size, {size / usual:.0f}x the usual step "
               f"({usual:.3g}; the largest so far {before:.3g}), while the gradient norm stayed ordinary ({grad:.3g}, its median "
               f"{level:.3g}): the update, not the gradient, changed{why}.")
        return self.make(step, msg, size, (self.WITH_LR * usual) if raised else self.jump * before, comp.name or "(all layers)",
                         ["weights", "corroborated"] if raised else ["weights"])

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": self._sizes, "grads": self._grads, "lr": self._lr, "rose": self._rose, "lr_top": self._lr_top,
                "lr_step": self._lr_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sizes = {k: [float(x) for x in v] for k, v in state.get("sizes", {}).items()}
        self._grads = {k: [float(x) for x in v] for k, v in state.get("grads", {}).items()}
        self._lr = {k: float(v) for k, v in state.get("lr", {}).items()}
        self._lr_step = {k: int(v) for k, v in state.get("lr_step", {}).items()}
        self._rose = {k: float(v) for k, v in state.get("rose", {}).items()}
        self._lr_top = {k: float(v) for k, v in state.get("lr_top", {}).items()}

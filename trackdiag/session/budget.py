"""The cost budget in the session (:mod:`trackdiag.session.budget_policy`), mixed into :class:`trackdiag.Diagnostics`:
each logging window's own and wall time go to the :class:`~trackdiag.session.budget_policy.Budget`; a shed it decides is
applied here (the flight recorder's flags, the NaN replay's mode, the probes' schedules), and between the
stretched logging steps one host read at the preset's cadence checks the window's every-step series."""
from __future__ import annotations

import logging
import math
import statistics
from typing import Any

import torch

from trackdiag.session.budget_policy import STRIDES, Budget, share_of
from trackdiag.util.schedule import Strided

log = logging.getLogger("trackdiag")
JUMP = 3.0  # a value this many times its level off the level asks for a logging step (the rules' factors: 10)


def _on_host(sources: dict[str, list[Any]]) -> dict[str, list[float]]:
    """Each source's values (0-d/1-d tensors or floats) as host floats: one copy per device."""
    out: dict[str, list[float]] = {src: [] for src in sources}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for src, vals in sources.items():
        for v in vals:
            if isinstance(v, torch.Tensor):
                if v.ndim != 1 or v.dtype is not torch.float32 or v.requires_grad:  # the probes' chunks are, already
                    v = v.detach().reshape(-1).float()
                by_device.setdefault(v.device, []).append((src, v))
            else:
                out[src].append(float(v))
    for parts in by_device.values():
        flat = torch.cat([t for _, t in parts]).tolist()
        i = 0
        for src, t in parts:
            out[src] += flat[i:i + t.numel()]
            i += t.numel()
    return out


class CostBudget:
    """``_init_budget``, ``_budget_window``, ``_window_check``, ``_budget_summary``; see the module docstring."""

    def _init_budget(self, cfg: dict[str, Any]) -> None:
        self._budget: Budget | None = None
        self._checks: list[Any] = []  # the preset's own schedules, once the logging step is stretched
        self._base: dict[Any, Any] = {}  # probe -> its schedule before any stretch
        self._gaps: list[float] | None = None  # per step: the loop's time between two step() calls
        self._clean = False  # the window since the last logging step began at a scheduled one
        self._levels: dict[str, float] = {}  # per source: the median of the previous check's values
        self._log_seconds = 0.0  # the last logging step's own time: it opens the next window (see _budget_window)
        self._windowed = [p for p in self.probes if hasattr(p, "window_values")]  # what a window check reads
        share = share_of(cfg.get("budget", "auto"), cfg["level"])
        if share is None or self._dist is not None:  # ranks must log at the same steps: no per-rank decisions
            return
        flight, replay = self._probe_named("flight"), self._probe_named("nan_replay")
        extras = (flight is not None and flight.flags is not None) or (replay is not None and replay.mode == "step")
        capture = replay is not None and replay.capturing
        self._budget = Budget(share, ["extras"] * extras + [f"every x{k}" for k in STRIDES] + ["capture"] * capture)
        self._gaps = []

    def _probe_named(self, name: str) -> Any:
        return next((p for p in self.probes if p.name == name and p.enabled), None)

    def _budget_window(self, step: int, own: float, hooks: float) -> None:
        """A logging window's end: ``own`` seconds of trackdiag's time since the last one, ``hooks`` of them inside
        the loop's passes. The loop's own time per step is the mean of the gaps between ``step()`` calls with
        the long ones left out (over 3x the median: an evaluation, a checkpoint, another model's turn), less
        the hooks. Only windows between two scheduled logging steps are judged (not an anomaly window's
        every-step logging, nor a NaN's)."""
        if self._budget is None or self._gaps is None:
            return
        gaps, self._gaps = self._gaps, []
        regular = any(s(step) for s in self._schedules)
        clean, self._clean = self._clean, regular
        if not (clean and regular) or len(gaps) < 2:
            return
        cap = 3 * statistics.median(gaps)
        kept = [g for g in gaps if g <= cap]
        loop = len(gaps) * sum(kept) / len(kept) - hooks  # the user's time in the window, trackdiag's left out
        told = self._budget.cannot
        shed = self._budget.window(step, own, loop + own, self._log_seconds)
        if told is None and self._budget.cannot is not None:
            self._say_cannot(self._budget.cannot["floor"], self._budget.share, loop / len(gaps))
        if shed is not None:
            self._shed(step, shed, self._budget)

    def _say_cannot(self, floor: float, share: float, step_s: float) -> None:
        """Once, as soon as it is known: trackdiag's work on every step alone is above the budget, which shedding
        logging steps cannot change (a step of a millisecond or two: the hooks' fixed cost)."""
        level = self.config["level"]
        lighter = {"extreme": "a lighter preset (advanced or basic)", "advanced": "a lighter preset (basic)"}.get(
            level, "more work per step (a larger batch): basic is the lightest preset")
        log.warning("trackdiag: its work on every step alone is ~%.0f%% of this loop's %.2f ms step, above the %.0f%% "
                    "cost budget of %r: logging less often cannot bring it under. It keeps shedding what it may; for "
                    "less, use %s, or diag.budget=null to keep the cadence and accept the cost.",
                    100 * floor, 1e3 * step_s, 100 * share, level, lighter)

    def _shed(self, step: int, shed: str, budget: Budget) -> None:
        ctx = self._ctx
        if shed == "extras":
            flight, replay = self._probe_named("flight"), self._probe_named("nan_replay")
            if flight is not None and flight.flags is not None:
                flight.stop_modules(ctx)
            if replay is not None:
                replay.to_log_mode(ctx)
            what = ("per-module output flags and the exact-step NaN replay off (the replay runs at the logging "
                    "step, from a weight snapshot)")
        elif shed == "capture":
            replay = self._probe_named("nan_replay")
            if replay is not None:
                replay.stop_capture(step)
            what = ("the NaN replay no longer keeps each training forward's arguments (a NaN step is replayed from "
                    "step(batch=...) when given; else it is raised without its module)")
        else:
            n = self.every * int(shed.rpartition("x")[2])
            if not self._base:
                self._base = {p: p.schedule for p in self.probes}
                self._checks = list(dict.fromkeys(self._base.values()))
            for p in self.probes:
                p.schedule = Strided(self._base.get(p, p.schedule), n)
            self._schedules = self._distinct_schedules()
            what = (f"logging every {n} steps instead of {self.every} (the window's losses and gradient norms "
                    f"still checked for NaN/Inf and jumps every {self.every})")
        budget.taken[-1]["what"] = what
        log.info("trackdiag: at step %d its own time was ~%.0f%% of each step, above the %.0f%% budget of %r: %s. "
                 "diag.budget=null keeps the preset's cadence.", step, 100 * budget.last, 100 * budget.share,
                 self.config["level"], what)

    def _window_check(self, step: int) -> bool:
        """Between stretched logging steps, at a step the preset would have logged: whether to log now. The
        window's every-step losses and pre-clip gradient norms since the last check, in one host read: a NaN/Inf, or
        a value ``JUMP``-fold off the level of the previous check (``|v - level| > JUMP x |level|``: a spike or an
        explosion the rules judge at once, as at the preset's own cadence), asks for a logging step. The probes keep
        what they stacked for it (``window_values``): the logging step does not stack those steps again."""
        if not any(s(step) for s in self._checks):
            return False
        sources: dict[str, list[Any]] = {}
        for p in self._windowed:
            if p.enabled:
                sources.update(p.window_values())
        values = _on_host(sources)
        for src, new in values.items():
            if not new:
                continue
            if not all(math.isfinite(v) for v in new):
                return True
            level = self._levels.get(src)
            if level is not None and any(abs(v - level) > JUMP * abs(level) for v in new):
                return True
            self._levels[src] = statistics.median(new)
        return False

    def _budget_summary(self) -> dict[str, Any] | None:
        b = self._budget
        if b is None:
            return None
        return {"share": b.share, "shed": list(b.taken), "over": b.over(), "cannot": b.cannot,
                "measured": None if math.isnan(b.last) else round(b.last, 4)}

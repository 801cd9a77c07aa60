"""Memory rules: ``memory_leak`` (steady growth) and ``memory_pressure`` (close to capacity).

They read the ``memory`` probe's keys: CUDA allocated memory when the model is on CUDA (exact,
allocator-level), else the process RSS (noisier: the allocator keeps freed pages, libraries load)."""
from __future__ import annotations

import itertools
import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope of ``ys`` over ``xs`` and the fit's R² (1.0 for a flat exact fit)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0:
        return 0.0, 0.0
    slope = sxy / sxx
    r2 = (sxy * sxy) / (sxx * syy) if syy > 0 else 1.0
    return slope, r2


def _leak_keys(record: Record) -> list[str]:
    cuda = [k for k in record.scalars if k.startswith("diag/mem/cuda_allocated_mb")]
    return cuda or (["diag/mem/rss_mb"] if "diag/mem/rss_mb" in record.scalars else [])


class MemoryLeak(Rule):
    """Fires when memory grows steadily: over the readings of the last ``window_steps`` (100) steps
    (at least ``min_points``, 5, spanning at least ``min_span``, 30, steps), the least-squares growth
    across them is at least ``min_growth_mb`` (32 MB: a 1 MB/step leak shows by step ~60), the linear
    fit explains it (R² >= ``min_r2``, 0.8) and at least ``min_rising`` (0.6) of the consecutive
    readings rise. Readings before step ``warmup`` (20) are ignored (start-up allocations).
    Allocator noise is flat or saw-toothed and fails the R²/rising guards, however densely it is read
    (anomaly windows read every step); a leak is a ramp. ``persistent`` (a warning) for CUDA allocated
    memory (exact), and for the host RSS only when the ramp is steady: R² >= ``rss_r2`` (0.95) and
    >= ``rss_rising`` (0.9) of the readings higher than the one before (a kept graph grows RSS at every
    step) and the ramp keeps its pace: the later half of the window grows at least ``rss_keep`` (0.6) x as
    fast as the earlier half (CPU bf16 autocast with a new batch shape every step fills oneDNN's caches: RSS
    climbs ~1 GB over the first 80 steps at a falling pace, then stays; a kept graph grows it at one pace).
    A looser host ramp is an ``info`` finding (allocator arenas growing in full-batch training)."""

    kind = "memory_leak"
    hint = ("Something keeps tensors alive across steps. The classic: storing the loss with its graph "
            "(losses.append(loss)) — store loss.item() or loss.detach(); also metrics lists of outputs, caches "
            "keyed by step, hooks that save activations, retain_graph=True.")

    def __init__(self, *, window_steps: int = 100, min_points: int = 5, min_span: int = 30, min_growth_mb: float = 32.0,
                 min_r2: float = 0.8, min_rising: float = 0.6, warmup: int = 20, rss_r2: float = 0.95,
                 rss_rising: float = 0.9, rss_keep: float = 0.6, **kw: Any) -> None:
        super().__init__(**kw)
        self.rss_r2, self.rss_rising, self.rss_keep = rss_r2, rss_rising, rss_keep
        self.window_steps, self.min_points, self.min_growth_mb = window_steps, max(min_points, 3), min_growth_mb
        self.min_span = min(min_span, window_steps)
        self.min_r2, self.min_rising, self.warmup = min_r2, min_rising, warmup

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key in _leak_keys(record):
            pts = _window_points(key, record, history, self.window_steps, self.warmup)
            if len(pts) < self.min_points or pts[-1][0] - pts[0][0] < self.min_span:
                continue
            xs, ys = [float(s) for s, _ in pts], [v for _, v in pts]
            slope, r2 = linear_fit(xs, ys)
            growth = slope * (xs[-1] - xs[0])
            rising = sum(b > a for a, b in zip(ys, ys[1:])) / (len(ys) - 1)
            if growth < self.min_growth_mb or r2 < self.min_r2 or rising < self.min_rising:
                continue
            what = "CUDA allocated memory" if "cuda" in key else "process RSS"
            # the allocator's count is exact; the host RSS also moves with the allocator's arenas, page cache and
            # kernel caches, so there only a ramp with (nearly) every reading higher that is not levelling off is a
            # leak, a looser one a finding
            kept = 1.0 if "cuda" in key else _kept_pace(xs, ys)
            slowing = kept < self.rss_keep
            steady = "cuda" in key or (r2 >= self.rss_r2 and rising >= self.rss_rising and not slowing)
            msg = (f"{what} grew {growth:.0f} MB over the last {int(xs[-1] - xs[0])} steps ({slope:.2f} MB/step, "
                   f"R²={r2:.2f}, {100 * rising:.0f}% of readings rising)"
                   + (f", levelling off (the later half of the window grew at {max(kept, 0.0):.0%} of the earlier "
                      f"half's pace: caches filling, not a leak, if it goes on flattening)" if slowing else "")
                   + f".{self._eta(record, key, slope)}")
            out.append(self.make(record.step, msg, growth, self.min_growth_mb, self._where(key),
                                 ["persistent"] if steady else []))
        return out

    @staticmethod
    def _where(key: str) -> str:
        return "cuda" + key.rpartition("_mb")[2].replace("/", ":") if "cuda" in key else "host"

    @staticmethod
    def _eta(record: Record, key: str, slope: float) -> str:
        """How many steps until the memory is full at this rate (host RSS only: the limit is known)."""
        frac, now = record.scalars.get("diag/mem/rss_frac"), record.scalars.get(key)
        if "cuda" in key or not frac or not now or slope <= 0:
            return ""
        left = now / frac - now
        return f" At this rate the memory limit is reached in about {left / slope:.0f} steps."


class MemoryPressure(Rule):
    """Fires when memory use is within ``1 - threshold`` of capacity: the CUDA peak reserved (or the
    whole device's use) above ``threshold`` (0.9) of the device memory, or the process RSS above
    ``threshold`` of the memory it may use (cgroup limit or RAM)."""

    kind = "memory_pressure"
    hint = ("Close to out-of-memory: lower the batch size and use gradient accumulation, enable mixed "
            "precision (bf16), activation checkpointing, set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "against fragmentation; on the host, fewer/lighter DataLoader workers.")

    def __init__(self, *, threshold: float = 0.9, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold = threshold

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, v in record.scalars.items():
            if not key.startswith("diag/mem/") or not (key.startswith("diag/mem/cuda_") and "_frac" in key or key == "diag/mem/rss_frac"):
                continue
            if not math.isfinite(v) or v <= self.threshold:
                continue
            what = {"cuda_peak_frac": "peak reserved CUDA memory", "cuda_device_used_frac": "memory in use on the CUDA device",
                    "rss_frac": "process RSS"}[key.split("/")[2]]
            where = "host" if key == "diag/mem/rss_frac" else "cuda" + ("" if key.count("/") == 2 else ":" + key.rsplit("/", 1)[1])
            out.append(self.make(record.step, f"{what} is {100 * v:.1f}% of capacity.", v, self.threshold, where, ["persistent"]))
        return out


def _kept_pace(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope over the later half of the readings (from the middle step on) as a share of
    the one over the earlier half (up to it); 1.0 when a half has fewer than 2 readings or did not grow."""
    mid = (xs[0] + xs[-1]) / 2
    early = [(x, y) for x, y in zip(xs, ys) if x <= mid]
    late = [(x, y) for x, y in zip(xs, ys) if x >= mid]
    if len(early) < 2 or len(late) < 2:
        return 1.0
    first, _ = linear_fit([x for x, _ in early], [y for _, y in early])
    second, _ = linear_fit([x for x, _ in late], [y for _, y in late])
    return second / first if first > 0 else 1.0


def _window_points(key: str, record: Record, history: Sequence[Record], steps: int, warmup: int) -> list[tuple[int, float]]:
    """The (step, value) readings of ``key`` within the last ``steps`` steps and from step ``warmup``
    on, oldest first; walks the history backwards and stops at the window's start."""
    pts: list[tuple[int, float]] = []
    start = max(warmup, record.step - steps)
    for r in itertools.chain((record,), reversed(history)):
        if r.step < start:
            break
        if key in r.scalars:
            pts.append((r.step, r.scalars[key]))
    return pts[::-1]

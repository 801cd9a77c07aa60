"""Memory timeline over steps, and an optional CUDA allocator snapshot.

``plot_memory`` reads the ``memory`` probe's scalars (``diag/mem/rss_mb``; on CUDA
``diag/mem/cuda_allocated_mb``, ``cuda_reserved_mb``, ``cuda_peak_mb``, per device with a ``/<i>``
suffix) and the ``memory_phases`` probe's ``diag/[<c>/]mem/phase/<start|forward|backward|step>_mb``, and
draws host memory, per CUDA device allocated / reserved / peak-since-last-log, and allocated memory
at each phase of the step. The y axes start at 0 (a flat RSS reads flat) and each panel's title gives
the change of each series from its first to its last reading.

``MemorySnapshot`` records the CUDA caching allocator's history for a few steps
(``torch.cuda.memory._record_memory_history``) and dumps a pickle that https://pytorch.org/memory_viz
opens (drag the file in). Recording costs a stack capture per allocation while it is on (a few
percent to ~2x on allocation-heavy steps), so keep the window short. On a machine without CUDA, or
a model not on CUDA, it does nothing.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Iterable

from trackdiag.core.errors import brief
from trackdiag.core.record import Record
from trackdiag.plots import figure, save, scalar_series

log = logging.getLogger("trackdiag")
_CUDA = ("cuda_allocated_mb", "cuda_reserved_mb", "cuda_peak_mb")
_PHASE = re.compile(r"^diag/(?:(?P<c>[^/]+)/)?mem/phase/(?P<phase>[^/]+)_mb$")
_PHASES = ("start", "forward", "backward", "step")


def _order(key: str) -> int:
    phase = _PHASE.match(key)["phase"]  # type: ignore[index]
    return _PHASES.index(phase) if phase in _PHASES else len(_PHASES)


def plot_memory(records: Iterable[Record], path: str | Path) -> Path | None:
    """Draw the memory timeline to ``path``; None when no memory scalars were logged."""
    records = list(records)
    series = scalar_series(records, "diag/mem/")
    for r in records:  # per-phase keys of named components: diag/<c>/mem/phase/<phase>_mb
        for k, v in r.scalars.items():
            if not k.startswith("diag/mem/") and _PHASE.match(k):
                series.setdefault(k, []).append((r.step, v))
    if not series:
        return None
    devices = sorted({k.split("/", 3)[3] if k.count("/") == 3 else "" for k in series if "/cuda_" in k})
    panels = [("host", ["diag/mem/rss_mb"])] if "diag/mem/rss_mb" in series else []
    for dev in devices:
        sfx = f"/{dev}" if dev else ""
        panels.append((f"cuda{':' + dev if dev else ''}", [f"diag/mem/{name}{sfx}" for name in _CUDA]))
    phases = sorted({k for k in series if _PHASE.match(k)}, key=lambda k: (_PHASE.match(k)["c"] or "", _order(k)))
    for comp in dict.fromkeys(_PHASE.match(k)["c"] or "" for k in phases):
        keys = [k for k in phases if (_PHASE.match(k)["c"] or "") == comp]
        panels.append((f"per phase{' — ' + comp if comp else ''}: cuda", keys))
    panels = [(t, [k for k in keys if k in series]) for t, keys in panels]
    panels = [(t, keys) for t, keys in panels if keys]
    if not panels:
        return None
    fig = figure(8.0, 2.8 * len(panels) + 0.4)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True)[:, 0]
    for ax, (title, keys) in zip(axes, panels):
        highest, changes = 0.0, []
        for key in keys:
            steps, vals = zip(*sorted(series[key]))
            m = _PHASE.match(key)
            label = m["phase"] if m else key.split("/")[2].removeprefix("cuda_").removesuffix("_mb")
            kind = "-" if "peak" not in key else "--"
            ax.plot(steps, vals, kind, marker=".", ms=3, lw=1.2, label=label)
            finite = [v for v in vals if math.isfinite(v)]
            if finite:
                highest = max(highest, max(finite))
                changes.append(f"{label} {finite[-1] - finite[0]:+.1f} MiB")
        # from 0: a flat 541 MiB RSS must look flat, not like a ramp over a 0.7 MiB window
        ax.set_ylim(0, max(highest * 1.15, 1.0))
        note = f" — change over the run: {', '.join(changes)}" if changes else ""
        ax.set_title(f"{title} memory (MiB){note}", fontsize=10, loc="left")
        ax.set_ylabel("MiB", fontsize=8)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step", fontsize=8)
    return save(fig, path)


class MemorySnapshot:
    """Record the CUDA allocator history for ``steps`` optimizer steps, then dump it to ``path``.

    Call ``start()`` once and ``step()`` after every optimizer step; ``path`` is set once the
    pickle is written. ``available()`` is False (and every call a no-op) without CUDA.
    """

    def __init__(self, path: str | Path | None, steps: int = 3, max_entries: int = 100_000) -> None:
        self.path = Path(path) if path is not None else None  # may be set any time before the dump
        self.steps = steps
        self.max_entries = max_entries
        self.written: Path | None = None
        self._left = -1

    @staticmethod
    def available() -> bool:
        import torch

        return bool(torch.cuda.is_available()) and hasattr(torch.cuda.memory, "_record_memory_history")

    def start(self) -> bool:
        """Begin recording; False (with nothing done) when CUDA is not available."""
        if self._left >= 0 or not self.available() or self.steps < 1:
            return False
        import torch

        try:
            torch.cuda.memory._record_memory_history(max_entries=self.max_entries)
        except Exception as exc:  # an older or restricted build
            log.warning("trackdiag: CUDA memory history not available: %s", brief(exc))
            return False
        self._left = self.steps
        return True

    def step(self) -> Path | None:
        """Count one step; after the last, dump the snapshot, stop recording and return its path."""
        if self._left <= 0:
            return None
        self._left -= 1
        if self._left:
            return None
        return self.stop()

    def stop(self) -> Path | None:
        """Dump what was recorded so far and stop recording (idempotent)."""
        import torch

        if self.written is not None or self._left < 0:  # already written, or never started
            return self.written
        self._left = 0
        try:
            if self.path is None:
                raise ValueError("no output path was set")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.path))
            self.written = self.path
        except Exception as exc:
            log.warning("trackdiag: could not write the CUDA memory snapshot: %s", brief(exc))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        return self.written

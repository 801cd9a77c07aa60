"""Memory probe: ``diag/mem/rss_mb`` (process resident set) and, for models on CUDA,
``diag/mem/cuda_allocated_mb``, ``diag/mem/cuda_reserved_mb``, ``diag/mem/cuda_peak_mb`` (peak since the
previous log). All read from host-side counters: no device sync."""
from __future__ import annotations

import os
from typing import Any

import torch

from trackdiag.context import ProbeContext
from trackdiag.probes.base import Probe

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> float:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return float(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil  # not Linux

        return float(psutil.Process().memory_info().rss)


class MemoryProbe(Probe):
    name = "memory"

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {"diag/mem/rss_mb": rss_bytes() / 2**20}
        devices = {p.device for c in ctx.components for p in c.index.params[:1] if p.device.type == "cuda"}
        for dev in devices:
            sfx = "" if len(devices) == 1 else f"/{dev.index}"
            out[f"diag/mem/cuda_allocated_mb{sfx}"] = torch.cuda.memory_allocated(dev) / 2**20
            out[f"diag/mem/cuda_reserved_mb{sfx}"] = torch.cuda.memory_reserved(dev) / 2**20
            out[f"diag/mem/cuda_peak_mb{sfx}"] = torch.cuda.max_memory_allocated(dev) / 2**20
            torch.cuda.reset_peak_memory_stats(dev)
        return out

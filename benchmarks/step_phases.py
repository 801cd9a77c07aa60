"""Where a non-logging step's time goes, phase by phase (issue 44): forward, backward, optimizer step (with
``zero_grad``) and ``diag.step``, bare loop against a preset, each phase's thread time (``time.thread_time_ns``: the
training thread's own CPU, robust to other jobs on the machine) and its Python calls (``sys.setprofile``: call and
c_call events, deterministic) and torch ops (a counting ``TorchDispatchMode``).

The two arms step in alternation, one step each, after ``--warmup`` steps alone (the cost budget off: ``+nobudget``,
so the cadence stays the preset's); a step is a logging step when the session's record count grew, and only the
others are kept. Prints, per phase, the median thread time of bare and preset and their difference, then the
median calls and ops.

Usage: python benchmarks/step_phases.py [--workloads small,seq2seq] [--presets basic] [--steps 1500]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import workloads  # noqa: E402
from arms import Arm  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "diag.step")


class _Ops(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on."""

    n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        _Ops.n += 1
        return func(*args, **(kwargs or {}))


def phased_step(arm: Arm, clock: Callable[[], int]) -> list[int]:
    """One step of ``arm`` (the loop of :meth:`Arm.step`, no scaler, no autocast), ``clock`` read between phases."""
    x, y = batch = arm.wl.make_batch(arm.gen)
    t = [clock()]
    if arm.wl.run is not None:
        loss, out = arm.wl.run(arm.net, batch)
    else:
        out = arm.net(x)
        loss = arm.loss_fn(out, y)
    t.append(clock())
    arm.backward(loss, out, y)
    t.append(clock())
    for opt in arm.opts.values():
        opt.step()
    for opt in arm.opts.values():
        opt.zero_grad(set_to_none=True)
    t.append(clock())
    arm.after(loss, out, batch)
    t.append(clock())
    arm.global_step += 1
    return [b - a for a, b in zip(t, t[1:])]


def counted(arm: Arm, kind: str) -> list[int]:
    """One step's Python calls (``kind="calls"``) or torch ops (``"ops"``) per phase."""
    n = [0]
    if kind == "calls":
        def prof(frame: Any, event: str, arg: Any) -> None:
            if event in ("call", "c_call"):
                n[0] += 1
        sys.setprofile(prof)
        try:
            return phased_step(arm, lambda: n[0])
        finally:
            sys.setprofile(None)
    with _Ops():
        return phased_step(arm, lambda: _Ops.n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="small,seq2seq")
    ap.add_argument("--presets", default="basic")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    for wname in a.workloads.split(","):
        wl = workloads.get(wname)
        for level in a.presets.split(","):
            bare = Arm("bare", wl, tmp, torch.device("cpu"))  # the same batches, step for step, as the preset's
            arm = Arm(f"{level}+nobudget", wl, tmp, torch.device("cpu"))
            bare.turn(a.warmup, timed=False)
            arm.turn(a.warmup, timed=False)
            tb: list[list[int]] = []
            ta: list[list[int]] = []
            for _ in range(a.steps):
                tb.append(phased_step(bare, time.thread_time_ns))
                ta.append(phased_step(arm, time.thread_time_ns))
            # non-logging steps: the arm's diag.step phase below its 90th percentile (logging steps are 1 in 10-50)
            cut = sorted(s[3] for s in ta)[int(0.9 * len(ta))]
            keep = [s for s in ta if s[3] < cut]
            cb = [counted(bare, "calls") for _ in range(20)]
            ca = [counted(arm, "calls") for _ in range(60)]
            ob = [counted(bare, "ops") for _ in range(5)]
            oa = [counted(arm, "ops") for _ in range(60)]
            print(f"\n{wname}, {level} (non-logging steps: {len(keep)} of {len(ta)}; thread us, median)")
            print(f"{'phase':<10} {'bare':>8} {level:>8} {'extra':>8} {'calls+':>7} {'ops+':>5}")
            tot = 0.0
            for i, ph in enumerate(PHASES):
                b = statistics.median(s[i] for s in tb) / 1e3
                p = statistics.median(s[i] for s in keep) / 1e3
                calls = statistics.median(s[i] for s in ca) - statistics.median(s[i] for s in cb)
                ops = statistics.median(s[i] for s in oa) - statistics.median(s[i] for s in ob)
                tot += p - b
                print(f"{ph:<10} {b:8.1f} {p:8.1f} {p - b:+8.1f} {calls:+7.0f} {ops:+5.0f}")
            print(f"{'total':<10} {'':>8} {'':>8} {tot:+8.1f}")
            arm.finish()


if __name__ == "__main__":
    main()

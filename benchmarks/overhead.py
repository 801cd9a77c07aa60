"""Overhead of trackdiag presets vs the bare loop, arms interleaved in ONE process.

    python benchmarks/overhead.py                       # all workloads, all arms
    python benchmarks/overhead.py --workloads mlp --rounds 10 --markdown

Each arm owns an identical model/optimizer (same init) and its own session. Arms are interleaved
**step by step**: a round is ``--steps`` steps of every arm, each step of the round running one step
of every arm in a fresh random order, so every arm's round covers the same stretch of wall time.
(Interleaving whole 50-step blocks instead left a per-block noise of 8-12 % on a shared 2-core VM,
and ratios that wandered by +-5 % between identical bare arms; step interleaving cuts the per-round
noise to ~2 %.) Reported per arm: median over rounds of wall time and process CPU time per step
(logging steps included, amortised); the ratios are medians of per-round ratios to the bare arm's
same round, with a 95 % interval (+-1.96 standard errors of the mean log ratio). For the preset
arms also the *attributed* ratio: 1 + (trackdiag's own time on the training thread, its
forward/backward hooks included, + the sink thread's CPU time) per step / the bare step time. It
misses indirect costs (cache pollution) but has none of the wall clock's noise. Peers:
``wandb.watch(model, log="all", log_freq=every)`` (offline). Cockpit is not an arm: it needs BackPACK and
torchvision, which has no CPU wheel for our torch, so an arm for it could never be run or checked here.
Landscapes are excluded from the preset arms (they are scheduled artifacts, timed separately).
"""
from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's trackdiag
from workloads import WORKLOADS, Workload  # noqa: E402

import trackdiag  # noqa: E402

PRESETS = ("basic", "advanced", "extreme")


class Arm:
    """One contender: its own model, optimizer, and per-step hook ``after(loss, out, x)``."""

    def __init__(self, name: str, wl: Workload, tmp: Path, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.name, self.wl = name, wl
        self.model = wl.make_model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.after: Callable[[Any, Any, Any], Any] = lambda loss, out, x: None
        self.closer: Callable[[], Any] = lambda: None
        self.walls: list[float] = []
        self.cpu: list[float] = []
        self.diag: Any = None
        self.attributed = float("nan")  # own ms/step over the measured rounds (preset arms)
        self._spent0 = 0.0
        self._steps = 0
        self._wall = self._cpu = 0.0
        if name == "disabled":
            diag = trackdiag.Diagnostics.from_config(None, model=self.model, optimizer=self.opt)
            self.after = lambda loss, out, x: diag.step(loss, outputs=out, batch=x)
        elif name in PRESETS:
            diag = trackdiag.Diagnostics(self.model, self.opt, level=name, sinks=["local"],
                                         output_dir=str(tmp / f"{wl.name}-{name}"), **_excluded())
            diag.__enter__()
            self.after = lambda loss, out, x: diag.step(loss, outputs=out, batch=x)
            self.closer = diag.close
            self.diag = diag
        elif name == "wandb.watch":
            import wandb

            run = wandb.init(mode="offline", dir=str(tmp), project="bench")  # watch() logs through the global run
            run.watch(self.model, log="all", log_freq=10)
            self.closer = run.finish

    def step(self) -> None:
        """One training step of this arm; its wall and process CPU time go to the current round."""
        m, opt, wl = self.model, self.opt, self.wl
        c0, t0 = time.process_time(), time.perf_counter()
        x, y = wl.make_batch(self.gen)
        out = m(x)
        loss = wl.loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        self.after(loss, out, x)
        self._wall += time.perf_counter() - t0
        self._cpu += time.process_time() - c0
        self._steps += 1

    def end_round(self, steps: int) -> None:
        self.walls.append(self._wall / steps)
        self.cpu.append(self._cpu / steps)
        self._wall = self._cpu = 0.0

    def spent(self) -> float:
        """trackdiag's own seconds so far: training-thread time (hooks included) + sink-thread CPU."""
        if self.diag is None:
            return 0.0
        o = self.diag.summary()["overhead"]
        return o["seconds"] + o["sink_thread_cpu_seconds"]

    def start_measuring(self) -> None:
        self.walls.clear()
        self.cpu.clear()
        self._spent0, self._steps, self._wall, self._cpu = self.spent(), 0, 0.0, 0.0

    def attributed_ms(self) -> float:
        """trackdiag's own milliseconds per measured step (nan for arms without a session)."""
        return 1e3 * (self.spent() - self._spent0) / self._steps if self.diag is not None and self._steps else float("nan")


def _excluded() -> dict[str, Any]:
    """Expensive scheduled artifacts (landscapes) are timed separately, not in the preset arms."""
    from trackdiag.registry import PROBES

    return {"probes": {"landscape": {"enabled": False}}} if "landscape" in PROBES else {}


def available_peers() -> list[str]:
    peers = []
    try:
        import wandb  # noqa: F401

        peers.append("wandb.watch")
    except ImportError:
        pass
    return peers


def bench(wl: Workload, arms: list[str], rounds: int, steps: int, warmup: int) -> dict[str, Arm]:
    tmp = Path(tempfile.mkdtemp(prefix="trackdiag-bench-"))
    contenders = {name: Arm(name, wl, tmp) for name in arms}
    for arm in contenders.values():
        for _ in range(warmup):
            arm.step()
        arm.start_measuring()
    order = list(contenders.values())
    for _ in range(rounds):
        for _ in range(steps):
            random.shuffle(order)
            for arm in order:
                arm.step()
        for arm in order:
            arm.end_round(steps)
    for arm in contenders.values():
        arm.attributed = arm.attributed_ms()  # before close: end-of-run artifacts excluded
        arm.closer()
    return contenders


def paired_ratio(arm: list[float], bare: list[float]) -> tuple[float, float]:
    """Median of the per-round ratios, and the half-width of a 95 % interval (1.96 standard errors
    of the mean log ratio, scaled to the ratio)."""
    ratios = [a / b for a, b in zip(arm, bare)]
    logs = [math.log(r) for r in ratios]
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.nan
    mid = statistics.median(ratios)
    return mid, mid * half


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50, help="steps per round (a multiple of every preset's cadence)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--arms", nargs="*", help="only these arms (bare is always run)")
    ap.add_argument("--markdown", action="store_true", help="print a README table")
    args = ap.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    arms = ["bare", "disabled", *PRESETS, *([] if args.no_peers else available_peers())]
    if args.arms:
        arms = ["bare", *[a for a in args.arms if a != "bare"]]
    rows = []
    for name in args.workloads:
        res = bench(WORKLOADS[name], arms, args.rounds, args.steps, args.warmup)
        bare = res["bare"]
        bare_ms = 1e3 * statistics.median(bare.walls)
        for arm in arms:
            a = res[arm]
            t, c = statistics.median(a.walls), statistics.median(a.cpu)
            rt, ci = paired_ratio(a.walls, bare.walls)
            rc, _ = paired_ratio(a.cpu, bare.cpu)
            own = a.attributed
            ra = 1.0 + own / bare_ms
            rows.append((name, arm, 1e3 * t, rt, ci, 1e3 * c, rc, own, ra))
            extra = f"   own {own:6.3f} ms/step  x{ra:.3f}" if own == own else ""
            print(f"{name:12s} {arm:12s} {1e3 * t:8.2f} ms/step  x{rt:.3f} ±{ci:.3f}   cpu {1e3 * c:8.2f} ms/step  x{rc:.3f}{extra}",
                  flush=True)
    if args.markdown:
        print("\n| workload | arm | ms/step | wall ratio (95 %) | CPU ratio | own ms/step | attributed ratio |\n|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            own = f"{r[7]:.3f} | {r[8]:.3f}" if r[7] == r[7] else "– | –"
            print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.3f} ±{r[4]:.3f} | {r[6]:.3f} | {own} |")


if __name__ == "__main__":
    main()

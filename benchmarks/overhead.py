"""Overhead of trackdiag presets vs the bare loop, arms interleaved in ONE process.

    python benchmarks/overhead.py                       # all workloads, all arms
    python benchmarks/overhead.py --workloads mlp --rounds 10 --markdown

Each arm owns an identical model/optimizer (same init) and its own session; every round runs a
block of steps of each arm in a shuffled order, so drift (thermal, other load) hits all arms alike.
Reported per arm: median over rounds of the mean wall time per step (logging steps included,
amortised) and of process CPU time per step; the ratios are medians of per-round ratios to the
bare block of the SAME round (paired), which cancels most of a shared VM's slow drifts. For the
preset arms also the *attributed* ratio: 1 + (trackdiag's own time on the training thread, its
forward/backward hooks included, + the sink thread's CPU time) per step / the bare step time. It
misses indirect costs (cache pollution) but has none of the wall clock's noise, which on a shared
2-core VM is larger than the budgets (see the ``disabled`` arm: it does nothing). Peers:
``wandb.watch(model, log="all", log_freq=every)`` (offline) and Cockpit's ``economy`` config when
``cockpit-for-pytorch`` imports (it needs torchvision, which has no CPU wheel on our machines).
Landscapes are excluded from the preset arms (they are scheduled artifacts, timed separately).
"""
from __future__ import annotations

import argparse
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
        self.blocks: list[float] = []
        self.cpu: list[float] = []
        self.diag: Any = None
        self.attributed = float("nan")  # own ms/step over the measured rounds (preset arms)
        self._spent0 = 0.0
        self._steps = 0
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
        elif name == "cockpit":
            self._cockpit()

    def _cockpit(self) -> None:  # pragma: no cover - only where cockpit-for-pytorch imports
        from backpack import extend
        from cockpit import Cockpit, CockpitPlotter  # noqa: F401

        self.model = extend(self.model)
        self.lossfn = extend(torch.nn.CrossEntropyLoss(reduction="mean"))
        raise NotImplementedError("cockpit arm needs per-sample losses wiring")

    def run_block(self, steps: int) -> None:
        m, opt, wl = self.model, self.opt, self.wl
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            x, y = wl.make_batch(self.gen)
            out = m(x)
            loss = wl.loss(out, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.after(loss, out, x)
        self.blocks.append((time.perf_counter() - t0) / steps)
        self.cpu.append((time.process_time() - c0) / steps)
        self._steps += steps

    def spent(self) -> float:
        """trackdiag's own seconds so far: training-thread time (hooks included) + sink-thread CPU."""
        if self.diag is None:
            return 0.0
        o = self.diag.summary()["overhead"]
        return o["seconds"] + o["sink_thread_cpu_seconds"]

    def start_measuring(self) -> None:
        self.blocks.clear()
        self.cpu.clear()
        self._spent0, self._steps = self.spent(), 0

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
    try:
        import cockpit  # noqa: F401

        peers.append("cockpit")
    except Exception:
        pass
    return peers


def bench(wl: Workload, arms: list[str], rounds: int, steps: int, warmup: int) -> dict[str, Arm]:
    tmp = Path(tempfile.mkdtemp(prefix="trackdiag-bench-"))
    contenders = {name: Arm(name, wl, tmp) for name in arms}
    for arm in contenders.values():
        arm.run_block(warmup)
        arm.start_measuring()
    order = list(contenders.values())
    for _ in range(rounds):
        random.shuffle(order)
        for arm in order:
            arm.run_block(steps)
    for arm in contenders.values():
        arm.attributed = arm.attributed_ms()  # before close: end-of-run artifacts excluded
        arm.closer()
    return contenders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50, help="steps per block (a multiple of every preset's cadence)")
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
        bare_ms = 1e3 * statistics.median(bare.blocks)
        for arm in arms:
            a = res[arm]
            t, c = statistics.median(a.blocks), statistics.median(a.cpu)
            rt = statistics.median(x / b for x, b in zip(a.blocks, bare.blocks))
            rc = statistics.median(x / b for x, b in zip(a.cpu, bare.cpu))
            own = a.attributed
            ra = 1.0 + own / bare_ms
            rows.append((name, arm, 1e3 * t, rt, 1e3 * c, rc, own, ra))
            extra = f"   own {own:6.3f} ms/step  x{ra:.3f}" if own == own else ""
            print(f"{name:12s} {arm:12s} {1e3 * t:8.2f} ms/step  x{rt:.3f}   cpu {1e3 * c:8.2f} ms/step  x{rc:.3f}{extra}", flush=True)
    if args.markdown:
        print("\n| workload | arm | ms/step | wall ratio | CPU ratio | own ms/step | attributed ratio |\n|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            own = f"{r[6]:.3f} | {r[7]:.3f}" if r[6] == r[6] else "– | –"
            print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.3f} | {r[5]:.3f} | {own} |")


if __name__ == "__main__":
    main()

"""Where a preset's time goes: trackdiag's own time per step, split by probe hook, rule and session part.

    python benchmarks/probe_costs.py --workload seq2seq --arm advanced            # CPU
    python benchmarks/probe_costs.py --workload gpt --arm extreme --device cuda   # GPU (gpt: bf16 autocast)

Runs one arm of a workload (benchmarks/workloads.py; an arm is a preset or ``preset+variant``, see
arms.py) and, around every hook the session calls, a wall-clock timer: each probe's ``on_step``,
``on_grads``, ``before_optimizer_step``/``after_optimizer_step``, ``collect``, ``publish`` and
``after_record``; each rule's ``check``; the end-of-backward tap, the optimizer-step dispatch, the
forward watchers (the call slots of :mod:`trackdiag.capture.root_call`, the module's own call excluded) and
``Diagnostics.step`` (logging steps amortised). A bare arm of the same workload, interleaved in blocks
with the timed one, gives the step time the costs are read against. Timers nest: the optimizer dispatch
holds the probes' ``on_grads`` and ``*_optimizer_step``; ``Diagnostics.step`` holds ``on_step`` and the
logging step, which holds ``collect``, ``publish``, ``after_record`` and the rules. Wall time of the training thread: on
CUDA a part that waits for the device (a host read) shows the wait; the GPU time of trackdiag's kernels
does not show (overhead.py's wall ratios hold it).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's trackdiag
import workloads  # noqa: E402
from arms import Arm  # noqa: E402

HOOKS = ("on_step", "on_grads", "before_optimizer_step", "after_optimizer_step", "collect", "publish", "after_record")


class Timers:
    def __init__(self) -> None:
        self.on = False  # timing only the measured arm's steps (torch's optimizer hooks are global: the bare arm's fire too)
        self.spent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        spent, calls, clock = self.spent, self.calls, time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += clock() - t0
                calls[label] += 1
        return timed

    def on_class(self, cls: type, name: str, label: str) -> None:
        setattr(cls, name, self.wrap(getattr(cls, name), label))


def instrument_classes(timers: Timers) -> None:
    """Session parts, on their classes (before the arm's session exists: hooks bind at attach)."""
    from trackdiag.capture import gradtap, optimizers, root_call
    from trackdiag.session import diagnostics as session

    timers.on_class(session.Diagnostics, "step", "Diagnostics.step")
    timers.on_class(session.Diagnostics, "_log", "logging step (all of it)")
    timers.on_class(session.Diagnostics, "_measured", "logging step: host copy + publish")
    timers.on_class(session.Diagnostics, "_judge", "logging step: rules")
    timers.on_class(session.Diagnostics, "_emit", "logging step: alerts + record to the sinks")
    timers.on_class(gradtap.GradTap, "end_of_backward", "end-of-backward tap (gradient norms)")
    timers.on_class(optimizers._Dispatch, "_pre", "optimizer dispatch")
    timers.on_class(optimizers._Dispatch, "_post", "optimizer dispatch")
    slot_call = root_call._Slot.__call__

    def watched_call(self: Any, *args: Any, **kwargs: Any) -> Any:  # the slot minus the module's own call
        if not timers.on:
            return slot_call(self, *args, **kwargs)
        impl = self.impl
        own = [0.0]

        def timed_impl(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return impl(*a, **k)
            finally:
                own[0] += time.perf_counter() - t
        self.impl = timed_impl
        t0 = time.perf_counter()
        try:
            return slot_call(self, *args, **kwargs)
        finally:
            self.impl = impl
            timers.spent["forward watchers (call slots)"] += time.perf_counter() - t0 - own[0]
            timers.calls["forward watchers (call slots)"] += 1
    root_call._Slot.__call__ = watched_call


def instrument_session(diag: Any, timers: Timers) -> None:
    for p in diag.probes:
        for name in HOOKS:
            if callable(getattr(p, name, None)):
                object.__setattr__(p, name, timers.wrap(getattr(p, name), f"probe {p.name}.{name}"))
    for r in diag.rules:
        r.check = timers.wrap(r.check, f"rule {r.kind}.check")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="seq2seq")
    ap.add_argument("--arm", default="advanced", help="a preset or preset+variant (arms.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=500, help="timed steps (a multiple of the logging cadence)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=30, help="untimed steps first (past the cost budget's decisions: ~1,200)")
    args = ap.parse_args()
    device = torch.device(args.device)
    wl = workloads.get(args.workload)
    amp = wl.amp if device.type == "cuda" else None
    timers = Timers()
    instrument_classes(timers)
    tmp = Path(tempfile.mkdtemp(prefix="probe-costs-"))
    bare, arm = Arm("bare", wl, tmp, device, amp=amp), Arm(args.arm, wl, tmp, device, amp=amp)
    instrument_session(arm.diag, timers)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for a in (bare, arm):
        for _ in range(args.warmup):
            a.step()
    timers.spent.clear()
    timers.calls.clear()
    walls: dict[str, list[float]] = {"bare": [], "arm": []}
    block = 50
    for _ in range(max(args.steps // block, 1)):
        for key, a in (("bare", bare), ("arm", arm)):
            sync()
            timers.on = a is arm
            t0 = time.perf_counter()
            for _ in range(block):
                a.step()
            sync()
            timers.on = False
            walls[key].append((time.perf_counter() - t0) / block)
    steps = max(args.steps // block, 1) * block
    b, w = statistics.median(walls["bare"]), statistics.median(walls["arm"])
    arm.closer()
    print(f"# {args.workload} / {args.arm} on {device.type}: bare {1e3 * b:.3f} ms/step, with trackdiag {1e3 * w:.3f} ms/step "
          f"(x{w / b:.3f}); torch {torch.__version__}")
    print("| part | us/step | calls/step | share of the bare step |")
    print("|---|---:|---:|---:|")
    for label, spent in timers.spent.most_common(args.top):
        per = spent / steps
        print(f"| {label} | {1e6 * per:.1f} | {timers.calls[label] / steps:.1f} | {per / b:.1%} |")


if __name__ == "__main__":
    main()

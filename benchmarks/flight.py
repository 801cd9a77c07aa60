"""Cost of the flight recorder: per-module output flags in every training forward, and the crash path.

    python benchmarks/flight.py                     # workloads small mlp cnn transformer, 1 thread
    python benchmarks/flight.py --workloads cnn --threads 2 --rounds 30

1. Flags: each workload's bare training step, interleaved step by step (random order in each slot)
   with the same step of a twin model (same weights, same batches) whose every module the flight
   recorder's :class:`~trackdiag.capture.output_flags.OutputFlags` watches (its call slots, the per-call
   append, and at ``end_step`` the placing, one sum per held tensor and the ``stack``: every step's
   flags, as on a step the NaN replay did not judge healthy). Reported: ms/step and the median of the paired per-round ratios (noisy for steps
   of tens of ms: the flags cost less than the steps' own spread), and the flags' own time, timed
   inside their hook and at ``end_step`` (what ``diag/perf/overhead_ms`` counts), per step, per
   recorded module call (it grows with the outputs' size: each is summed once) and as a share of
   the step. The preset arms' end-to-end numbers are in
   ``overhead.py --arms advanced advanced+modules extreme extreme+nomodules``.
2. Crash path: the time from the exception to the end of ``close()`` with the ``crash`` finding
   written (a replay of the running step's forward at ``advanced``; the flags' read at
   ``advanced+modules``), local sink only.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
import workloads  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.capture.context import Component, ProbeContext  # noqa: E402
from trackdiag.capture.layers import LayerIndex  # noqa: E402
from trackdiag.capture.output_flags import OutputFlags  # noqa: E402


def flags_cost(name: str, rounds: int, steps: int) -> dict[str, float]:
    wl = workloads.get(name)

    def twin() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Generator]:
        torch.manual_seed(0)
        model = wl.make_model()
        return model, torch.optim.AdamW(model.parameters(), lr=wl.lr), torch.Generator().manual_seed(1)

    arms = {"bare": twin(), "flags": twin()}  # the same weights and batches; only the second is watched
    model, opt, _ = arms["flags"]
    comp = Component("", model, opt, LayerIndex.build(model, list(model.parameters()), 64))
    ctx = ProbeContext([comp], 10, 64)
    flags = OutputFlags(ctx, ring=11)
    flags.start()
    counter: list[int] = []
    own = [0.0, 0]  # the flags' own time (timed inside their watcher and at end_step), flagged steps

    def step(i: int, arm: str) -> None:
        model, opt, gen = arms[arm]
        x, y = wl.make_batch(gen)
        loss = wl.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if arm == "flags":  # every step's flags computed (no NaN replay judging steps healthy here)
            counter.append(flags.recorded(i, running=True))
            t0 = time.perf_counter()
            flags.end_step(i)
            own[0] += time.perf_counter() - t0 + ctx.hook_seconds
            own[1] += 1
            ctx.hook_seconds = 0.0

    order = list(arms)
    for i in range(5):
        for arm in order:
            step(i, arm)
    per: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(rounds):
        tot = dict.fromkeys(arms, 0.0)
        for i in range(steps):
            random.shuffle(order)
            for arm in order:
                t0 = time.perf_counter()
                step(i, arm)
                tot[arm] += time.perf_counter() - t0
        for arm in arms:
            per[arm].append(tot[arm] / steps)
    flags.stop()
    bare, flagged = statistics.median(per["bare"]), statistics.median(per["flags"])
    ratio = statistics.median([f / h for f, h in zip(per["flags"], per["bare"])])
    calls = statistics.median(counter) if counter else float("nan")
    own_ms = 1e3 * own[0] / max(own[1], 1)
    return {"bare_ms": 1e3 * bare, "flags_ms": 1e3 * flagged, "ratio": ratio, "calls": calls, "own_ms": own_ms,
            "us_per_call": 1e3 * own_ms / calls if calls else float("nan")}


def crash_cost(name: str, variant: str) -> float:
    """Seconds from the exception to the end of close() (the crash finding written)."""
    wl = workloads.get(name)
    torch.manual_seed(0)
    model = wl.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=wl.lr)
    gen = torch.Generator().manual_seed(1)
    probes = {"report": {"enabled": False}, "landscape": {"enabled": False},
              "flight": {"modules": variant == "modules"}}
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], probes=probes,
                                 output_dir=tempfile.mkdtemp(prefix="flight-bench-"))
    t0 = 0.0
    try:
        with diag:
            for i in range(25):
                x, y = wl.make_batch(gen)
                out = model(x)
                if i == 24:
                    t0 = time.perf_counter()
                    raise RuntimeError("planted")
                wl.loss(out, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                diag.step(wl.loss(out, y).detach(), batch=x)
    except RuntimeError:
        pass
    assert [a.kind for a in diag.alerts][-1:] == ["crash"]
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", default=["small", "mlp", "cnn", "transformer"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# CPU, {args.threads} thread(s), torch {torch.__version__}; {args.rounds} rounds of {args.steps} interleaved steps")
    print("| workload | bare step (ms) | with the flags (ms) | wall ratio | module calls/step |"
          " flags' own ms/step | own us per call | own / step | crash finding, advanced (ms) | crash finding, +modules (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.workloads:
        r = flags_cost(name, args.rounds, args.steps)
        c = [1e3 * crash_cost(name, v) for v in ("replay", "modules")]
        print(f"| {name} | {r['bare_ms']:.2f} | {r['flags_ms']:.2f} | {r['ratio']:.3f} | {r['calls']:.0f} | "
              f"{r['own_ms']:.3f} | {r['us_per_call']:.1f} | {100 * r['own_ms'] / r['bare_ms']:.1f} % | {c[0]:.0f} | "
              f"{c[1]:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Overhead of trackdiag presets vs the bare loop, arms interleaved in ONE process.

    python benchmarks/overhead.py                       # default workloads, all arms, CPU
    python benchmarks/overhead.py --workloads mlp --rounds 10 --markdown
    python benchmarks/overhead.py --tensors 10 100 1000 3000 --arms basic extreme   # scaling rows only
    python benchmarks/overhead.py --compile             # bare/basic/advanced on torch.compile'd models
    python benchmarks/overhead.py --device cuda --workloads gpt mlp --markdown      # GPU (gpt: bf16 autocast)

Each arm owns an identical model/optimizer (same init, same batches) and its own session. Arms are
interleaved **step by step**: a round is ``--steps`` steps of every arm, each slot of the round
running ``--block`` steps of every arm in a fresh random order, so every arm's round covers the same
stretch of wall time. (Interleaving whole 50-step blocks instead left a per-block noise of 8-12 % on a
shared 2-core VM; step interleaving cuts the per-round noise to ~2 %.) On CUDA each turn is bracketed
by ``torch.cuda.synchronize()``, so it holds exactly its own kernels; ``--block`` (default 10 on
CUDA) keeps several steps in flight per turn, so a logging step's host sync stalls a queue as it would
in training. Reported per arm: median over rounds of wall time and process CPU time per step (logging
steps included, amortised); the ratios are medians of per-round ratios to the bare arm's same round,
with a 95 % interval (+-1.96 standard errors of the mean log ratio). For the preset arms also the
*attributed* ratio: 1 + (trackdiag's own time on the training thread, its hooks included, + the sink
thread's CPU time) per step / the bare step time. It misses indirect costs (cache pollution; on CUDA,
the GPU time of trackdiag's kernels) but has none of the wall clock's noise.

``--compile``: every arm's model is ``torch.compile``-d (the session wraps the compiled module, as a
user's would) and the ratios are to the compiled bare loop. Compile accounting first: each arm runs
``--warmup + --steps`` steps *alone* from a fresh Dynamo state at the default recompile limit (8), as
in a user's process, and its graph breaks, unique graphs and frames compiled
(``torch._dynamo.utils.counters``) and recompile-limit hits are recorded. Then Dynamo is reset and all
arms are timed together with the limit raised to 8 x arms (the arms share code: ``Module.__call__``,
trackdiag's hooks, and would otherwise push each other over it); frames compiled during the timed
rounds are reported too (they mean the timing includes compiles). ``--backend`` (default ``inductor``):
``aot_eager`` gives the same graphs and counts without Inductor's code generation (the tests' check of the table).

Workloads (workloads.py, gpt.py): mlp, cnn, transformer (a 2-layer LM), deep_narrow (1,000 tensors with a
LayerNorm), and the scaling rows scale10/100/1000/3000 (exactly that many parameter tensors at ~constant
multiply-adds); on CUDA also gpt (~111M parameters, bf16 autocast). gpt_tiny is gpt's code at CPU size.

Peers: ``wandb.watch(model, log="all", log_freq=10)`` (offline) and Cockpit (``economy``, tracking
every 10 steps, through BackPACK; install with ``bash scripts/bench_setup.sh``), on the workloads
BackPACK supports (the others are skipped with the reason printed). Landscapes are excluded from the
preset arms (they are scheduled artifacts, timed separately).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's trackdiag
import workloads  # noqa: E402
import arms as arm_setup  # noqa: E402  (its BACKEND; `arms` is the arm names below)
from arms import PRESETS, Arm, watch_recompile_limit  # noqa: E402
from table import line_of, markdown, row_of  # noqa: E402

import cockpit_arm  # noqa: E402


def available_peers() -> list[str]:
    peers = []
    try:
        import wandb  # noqa: F401

        peers.append("wandb.watch")
    except ImportError:
        pass
    if cockpit_arm.importable():
        peers.append("cockpit")
    return peers


def skip_reason(arm: str, wl: workloads.Workload, device: torch.device, compiled: bool, amp: torch.dtype | None,
                explicit: bool = False) -> str | None:
    """Why ``arm`` does not run on this workload/setting (printed), or None."""
    if compiled and wl.parts is not None:
        return "a workload of several models driven by a Python loop is timed eager only"
    if arm == "cockpit" and wl.run is not None:
        return "Cockpit needs one model called once per step on a batch (BackPACK extends a batched loss)"
    if arm == "cockpit":
        if not cockpit_arm.importable():
            return "Cockpit/BackPACK not installed (bash scripts/bench_setup.sh)"
        return cockpit_arm.unsupported(wl.make_model(), compiled=compiled, scaled=amp == torch.float16 and device.type == "cuda")
    if arm == "wandb.watch" and compiled:
        return "wandb.watch's tensor hooks under torch.compile are not a supported setting"
    if arm == "wandb.watch" and not explicit and sum(1 for _ in wl.make_model().parameters()) > 500:
        return "wandb.watch(log='all') on > 500 tensors takes minutes per round (name it in --arms to run it)"
    return None


def bench(wl: workloads.Workload, arms: list[str], rounds: int, steps: int, warmup: int, block: int, device: torch.device,
          compiled: bool, amp: torch.dtype | None, failed: list[str]) -> dict[str, Arm]:
    """Every arm of one workload, interleaved; arms that cannot start go to ``failed`` ("name: why")."""
    tmp = Path(tempfile.mkdtemp(prefix="trackdiag-bench-"))
    contenders: dict[str, Arm] = {}
    for name in arms:
        try:
            contenders[name] = Arm(name, wl, tmp, device, compiled, amp)
        except Exception as exc:  # noqa: BLE001 - an arm that cannot even start is reported, not fatal
            failed.append(f"{name}: could not start: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
    if compiled:  # each arm alone first (its own compile story), then all from a fresh state for timing
        from torch._dynamo import config as dynamo_config, reset

        for arm in contenders.values():
            arm.account(warmup + steps)
        reset()
        dynamo_config.recompile_limit = 8 * len(contenders)
    for arm in contenders.values():
        for _ in range(max(1, warmup // block)):
            arm.turn(min(block, warmup), timed=False)
        arm.start_measuring()
    order = list(contenders.values())
    for _ in range(rounds):
        for _ in range(steps // block):
            random.shuffle(order)
            for arm in order:
                arm.turn(block)
        for arm in order:
            arm.end_round(steps)
    for arm in contenders.values():
        arm.finish()
    return contenders


def environment(device: torch.device, compiled: bool, amp: str) -> str:
    dev = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    backend = "" if arm_setup.BACKEND == "inductor" else f" ({arm_setup.BACKEND})"
    return f"device: {dev} | torch {torch.__version__} | compile: {'on' + backend if compiled else 'off'} | amp: {amp}"


def _write_json(path: Path | None, device: torch.device, args: argparse.Namespace, rows: list[dict[str, Any]], skipped: list[str],
                done: bool = False) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"environment": environment(device, args.compile, args.amp), "complete": done, "rows": rows, "skipped": skipped,
            "settings": {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "block", "compile", "backend", "amp")}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1, default=str))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="*", help=f"default: {' '.join(workloads.DEFAULT)} (+ gpt on CUDA); "
                    f"short: {' '.join(workloads.SHORT)}")
    ap.add_argument("--tensors", nargs="*", type=int, default=[], help="add scale<T> workloads: T parameter tensors, ~constant FLOPs")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=50, help="steps per round (a multiple of every preset's cadence)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--block", type=int, help="steps per turn (default 1 on CPU, 10 on CUDA); divides --steps")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--compile", action="store_true", help="torch.compile every arm's model (default arms: bare basic advanced)")
    ap.add_argument("--backend", default="inductor", help="torch.compile's backend under --compile (aot_eager: Dynamo's "
                    "graphs without Inductor's code generation, for checking the table, not for timing)")
    ap.add_argument("--amp", choices=["auto", "none", "bf16", "fp16"], default="auto",
                    help="CUDA autocast: auto = the workload's own (gpt: bf16); fp16 steps through a GradScaler")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a busy shared box, where "
                    "2 spinning OpenMP threads per process can slow a step 10x)")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--arms", nargs="*", help="only these arms (bare is always run)")
    ap.add_argument("--markdown", action="store_true", help="print a README table")
    ap.add_argument("--json", type=Path, help="write the rows (and the environment) to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False (torch " + torch.__version__ + "): no CPU numbers reported instead")
    block = args.block = args.block or (10 if device.type == "cuda" else 1)
    if args.steps % block:
        raise SystemExit(f"--block {block} must divide --steps {args.steps}")
    if args.workloads:
        names = [n for w in args.workloads for n in (workloads.SHORT if w == "short" else [w])]
    else:  # --tensors alone: only the scaling rows
        names = [] if args.tensors else [*workloads.DEFAULT, *(["gpt"] if device.type == "cuda" else [])]
    names += [f"scale{t}" for t in args.tensors if f"scale{t}" not in names]
    if args.arms:
        arms = ["bare", *[a for a in args.arms if a != "bare"]]
    elif args.compile:
        arms = ["bare", "basic", "advanced"]
    else:
        arms = ["bare", "disabled", *PRESETS, *([] if args.no_peers else available_peers())]
    arm_setup.BACKEND = args.backend
    if args.compile:
        watch_recompile_limit()
    print("#", environment(device, args.compile, args.amp), flush=True)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    for name in names:
        wl = workloads.get(name)
        if wl.cuda_only and device.type != "cuda":
            print(f"{name:24s} skipped: CUDA-only workload (use --device cuda; gpt_tiny is its CPU-sized twin)", flush=True)
            continue
        amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp, wl.amp) if device.type == "cuda" else None
        label = name + (" (compiled)" if args.compile else "") + (f" [{str(amp).removeprefix('torch.')}]" if amp else "")
        run = []
        for arm in arms:
            why = skip_reason(arm, wl, device, args.compile, amp, explicit=bool(args.arms) and arm in args.arms)
            if why:
                skipped.append(f"{label} / {arm}: {why}")
                print(f"{label:24s} {arm:12s} skipped: {why}", flush=True)
            else:
                run.append(arm)
        failed: list[str] = []
        res = bench(wl, run, args.rounds, args.steps, args.warmup, block, device, args.compile, amp, failed)
        for why in failed:
            arm, _, err = why.partition(": ")
            rows.append({"workload": label, "arm": arm, "error": err, "notes": []})
            print(line_of(rows[-1]), flush=True)
        if "bare" not in res:
            continue
        for arm in run:
            if arm in res:
                rows.append(row_of(label, res[arm], res["bare"], args.compile))
                print(line_of(rows[-1]), flush=True)
        _write_json(args.json, device, args, rows, skipped)  # after every workload: a run cut short keeps what it measured
        del res  # every arm's model, optimizer and session, before the next workload's are built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.markdown:
        print("\n" + markdown(rows, args.compile))
        if skipped:
            print("\nSkipped: " + "; ".join(skipped))
    _write_json(args.json, device, args, rows, skipped, done=True)
    return 1 if any(r.get("error") and r["arm"] == "bare" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

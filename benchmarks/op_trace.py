"""Where an arm's time goes by *operation*: ``torch.profiler`` over a few steps of each arm, side by side
with the bare loop, on the CPU or a GPU. Complements ``probe_costs.py`` (time per trackdiag hook): in a
loop the GPU bounds, a hook's time there may be a wait for the device that merely landed in it; the
profiler tells kernel launches, allocator calls (``cudaMalloc``), host syncs (``cudaStreamSynchronize``,
``aten::_local_scalar_dense``) and device time apart.

    python benchmarks/op_trace.py --workload gpt --arms extreme+logreplay extreme+lean --device cuda

Prints per arm: wall ms/step under the profiler (inflated by it, compare arms with each other), device
ms/step, counts per step of kernel launches, allocator calls and syncs, and the top ops by self CPU time
per step. Each arm is profiled alone, after ``--warmup`` untimed steps of every arm.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workloads  # noqa: E402
from arms import Arm  # noqa: E402

#: host-side events worth a count per step: launches, allocator, syncs and copies
WATCHED = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMalloc", "cudaFree", "cudaStreamSynchronize",
           "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "aten::_local_scalar_dense")


def _device_us(e: object) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(e, name, None)
        if v is not None:
            return float(v)
    return 0.0


def trace(arm: Arm, steps: int, top: int) -> list[str]:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if arm.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        arm.turn(steps, timed=False)
        wall = (time.perf_counter() - t0) / steps
    if arm.error:
        return [f"## {arm.name}: failed ({arm.error})"]
    ka = prof.key_averages()
    dev = sum(_device_us(e) for e in ka) / steps / 1e3
    counts = {e.key: e.count / steps for e in ka if e.key in WATCHED}
    lines = [f"## {arm.name}: {wall * 1e3:.2f} ms/step wall under the profiler, {dev:.2f} ms/step device",
             "per step: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(counts.items())),
             "| op | self CPU us/step | calls/step | device us/step |", "|---|---:|---:|---:|"]
    for e in sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]:
        lines.append(f"| {e.key[:60]} | {e.self_cpu_time_total / steps:.1f} | {e.count / steps:.1f} | {_device_us(e) / steps:.1f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="seq2seq")
    ap.add_argument("--arms", nargs="+", default=["advanced"], help="arms besides bare (arms.py names)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    logging.getLogger("trackdiag").setLevel(logging.ERROR)
    device = torch.device(args.device)
    wl = workloads.get(args.workload)
    tmp = Path(tempfile.mkdtemp(prefix="op-trace-"))
    arms = [Arm(name, wl, tmp, device) for name in ["bare", *args.arms]]
    for arm in arms:
        arm.turn(args.warmup, timed=False)
    print(f"# {args.workload} on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}), "
          f"torch {torch.__version__}, {args.steps} profiled steps per arm")
    for arm in arms:
        print("\n".join(trace(arm, args.steps, args.top)), flush=True)
    for arm in arms:
        arm.finish()


if __name__ == "__main__":
    main()

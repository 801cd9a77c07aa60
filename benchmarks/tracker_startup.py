"""What the tracker's own process costs a short-step loop: the README example's loop, one process per arm.

    python benchmarks/tracker_startup.py                          # arms none, local, mlflow; 3 rounds of 600 steps
    python benchmarks/tracker_startup.py --threads 1 --rounds 5   # the same with one torch thread

overhead.py interleaves its arms in one process, so whatever a tracker does in a process of its own (the MLflow sink's
delivery worker: importing MLflow, making the store and the run, writing batches, drawing histogram images) lands in
every arm's steps alike and cancels out; and its arms log to the local record only. Here each arm is a fresh Python
process training the example's model (digits-sized MLP, Adam, batch 64, ``advanced``) with one sink: ``none`` (no
session: the bare loop), ``local`` (the run directory only) and ``mlflow`` (the default: a new SQLite store beside the
run, through the delivery worker); ``--arms ... wandb`` adds W&B offline (its own ``wandb-core`` process). Arms alternate within each round. Printed per arm: the milliseconds per step of
each block of 50 steps (median over rounds) and the whole loop's wall time (median, min-max), so a cost that only
the start of a run pays shows where it falls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 50

_CHILD = r"""
import json, sys, time
import torch, torch.nn.functional as F
from torch import nn
sink, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.Adam(model.parameters(), 1e-3)
x, y = torch.rand(1400, 64), torch.randint(0, 10, (1400,))
gen = torch.Generator().manual_seed(1)
diag = None
if sink != "none":
    import trackdiag
    extra = {"sink": {"wandb": {"mode": "offline", "dir": out, "project": "bench"}}} if sink == "wandb" else {}
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=[sink], output_dir=out + "/diag", **extra)
    diag.__enter__()
blocks, t0, start = [], time.perf_counter(), time.perf_counter()
for step in range(steps):
    idx = torch.randint(0, 1400, (64,), generator=gen)
    out_ = model(x[idx])
    loss = F.cross_entropy(out_, y[idx])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    if diag is not None:
        diag.step(loss, outputs=out_, batch=(x[idx], y[idx]))
    if (step + 1) % BLOCK == 0:
        now = time.perf_counter()
        blocks.append(1e3 * (now - t0) / BLOCK)
        t0 = now
loop = time.perf_counter() - start
if diag is not None:
    diag.close()
print(json.dumps({"blocks": blocks, "loop_s": loop}))
""".replace("BLOCK", str(BLOCK))


def run_arm(sink: str, steps: int, threads: int | None) -> dict:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="tracker-startup-") as tmp:  # the MLflow store lands beside the run
        proc = subprocess.run([sys.executable, "-c", _CHILD, sink, str(steps), tmp], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"arm {sink} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=["none", "local", "mlflow"], choices=["none", "local", "mlflow", "wandb"])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the arms (default: torch's own)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.steps < BLOCK:
        ap.error(f"--steps must be at least {BLOCK}")
    got: dict[str, list[dict]] = {a: [] for a in args.arms}
    for _ in range(args.rounds):
        for arm in args.arms:
            got[arm].append(run_arm(arm, args.steps, args.threads))
    rows = []
    threads = args.threads or "torch's default"
    print(f"# {args.steps} steps a run, {args.rounds} rounds, {os.cpu_count()} cores, threads: {threads}")
    print(f"| arm | loop s (median, min-max) | ms/step per block of {BLOCK} steps (median over rounds) |")
    print("|---|---|---|")
    for arm, runs in got.items():
        loops = [r["loop_s"] for r in runs]
        blocks = [statistics.median(b) for b in zip(*(r["blocks"] for r in runs))]
        rows.append({"arm": arm, "loop_s": statistics.median(loops), "loop_min": min(loops), "loop_max": max(loops),
                     "blocks_ms": blocks})
        print(f"| {arm} | {statistics.median(loops):.2f} ({min(loops):.2f}-{max(loops):.2f}) | "
              f"{' '.join(f'{b:.1f}' for b in blocks)} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    t = time.perf_counter()
    main()
    print(f"# {time.perf_counter() - t:.0f} s")

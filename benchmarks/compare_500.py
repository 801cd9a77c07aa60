"""Benchmark: ``trackdiag compare`` over 500 synthetic runs written in the local-record format.

Each run (a 5 lr x 5 depth x 20 seed grid, 1000 steps logged every 50, the loss series of every
step, an eval loss every 200 steps) is written through the real :class:`LocalSink`, so the files
are exactly what training writes. High learning rates diverge and raise alerts.

    python benchmarks/compare_500.py [--runs 500] [--keep DIR] [--plots]
"""
from __future__ import annotations

import argparse
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

from trackdiag.core.alert import Alert
from trackdiag.alerts.book import AlertBook
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.local import LocalSink

LRS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0]
DEPTHS = [2, 4, 8, 16, 32]


def write_run(sweep: Path, num: int, lr: float, depth: int, seed: int, steps: int = 1000, every: int = 50) -> None:
    """One synthetic Hydra job: ``<sweep>/<num>/diag/`` with run.json, records, alerts, summary."""
    rng = random.Random(num)
    sink, book = LocalSink(), AlertBook()
    hparams = {"seed": seed, "steps": steps, "model": {"depth": depth, "hidden": 64},
               "optimizer": {"name": "adam", "lr": lr}}
    sink.open(RunInfo(name=f"train-lr={lr},depth={depth},seed={seed}#{num}", output_dir=sweep / str(num) / "diag",
                      level="basic", config={"level": "basic"}, hparams=hparams, group=str(sweep), job_num=num))
    blowup = None if lr < 0.1 and depth < 32 else rng.randint(100, 900)  # unstable settings diverge
    loss = 2.3
    pending: list[tuple[int, float]] = []
    for step in range(steps):
        loss = loss * (0.997 + 0.004 * rng.random()) if blowup is None or step < blowup else loss * 1.3
        pending.append((step, loss if loss < 1e30 else math.inf))
        alerts = []
        if blowup is not None and step in (blowup + 3, blowup + 60):
            kind, sev = ("loss_divergence", "critical") if step == blowup + 3 else ("grad_explosion", "warning")
            alerts.append(Alert(kind=kind, step=step, severity=sev, message="synthetic"))
        for a in alerts:
            if book.admit(a, cooldown=50):
                sink.alert(a)
        if step % every == 0 or alerts:
            scalars = {"diag/grad/global_norm": rng.random(), "diag/opt/lr": lr}
            if step % 200 == 199:
                scalars["diag/eval/loss"] = loss * 1.05
            sink.write(Record(step=step, scalars=scalars, series={"diag/loss": pending}, alerts=alerts))
            pending = []
    sink.close("FINISHED", {"steps": steps, "health": book.health(),
                            "alerts": {k: dict(v) for k, v in book.kinds.items()}, "overhead": {}})


def make_sweep(root: Path, runs: int) -> Path:
    """``runs`` synthetic jobs in ``root`` (a Hydra-like multirun dir)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    for num in range(runs):
        write_run(root, num, LRS[num % 5], DEPTHS[(num // 5) % 5], seed=num // 25)
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=500)
    ap.add_argument("--keep", type=Path, default=None, help="write the sweep here and keep it")
    ap.add_argument("--plots", action="store_true", help="also time plots + comparison.html")
    args = ap.parse_args()
    from trackdiag.compare import compare, write_outputs
    from trackdiag.compare.table import to_csv

    tmp = Path(tempfile.mkdtemp(prefix="trackdiag_bench_")) if args.keep is None else args.keep
    try:
        t0 = time.perf_counter()
        sweep = make_sweep(tmp / "sweep" if args.keep is None else tmp, args.runs)
        t1 = time.perf_counter()
        comparison = compare(sweep)
        csv_text = to_csv(comparison)
        t2 = time.perf_counter()
        print(f"wrote {args.runs} runs in {t1 - t0:.2f} s")
        print(f"compare {args.runs} runs (read + table + risk + CSV): {t2 - t1:.2f} s -> {comparison.headline}")
        print(f"  CSV: {len(csv_text.splitlines()) - 1} rows; swept: {', '.join(comparison.swept)}")
        for line in comparison.risk_lines[:5]:
            print(f"  {line}")
        if args.plots:
            t3 = time.perf_counter()
            write_outputs(comparison, tmp / "report")
            print(f"plots + comparison.html/csv/json: {time.perf_counter() - t3:.2f} s")
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What the training thread pays per logged step for the MLflow sink, with 1000 metrics per record.

Two numbers, against a real local SQLite store in a temp dir:

- direct: the time ``SinkHub.write(record)`` takes on the training thread (a queue put: the
  sink's work and all MLflow I/O happen on the sink and delivery threads, and by default in a
  child process). Budget: < 1 ms/step. Printed beside the same call with a do-nothing sink.
- contention: how much longer a fixed torch workload takes per logged step while the records are
  converted and sent (threads of this process share its GIL; the default worker process shares
  the CPUs, at lower priority), versus the same workload with no sink at all.

It also prints the background throughput (metric points/s into SQLite). Usage:
    python benchmarks/mlflow_sink.py [--steps 100] [--metrics 1000] [--work-ms 20] [--delivery thread]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.base import Sink, SinkHub
from trackdiag.sinks.mlflow.sink import MlflowSink


def _workload(ms: float) -> tuple[torch.Tensor, int]:
    """A matmul chain calibrated to take about ``ms`` milliseconds."""
    x = torch.randn(192, 192)
    t0 = time.perf_counter()
    for _ in range(50):
        x @ x
    per = (time.perf_counter() - t0) / 50
    return x, max(1, int(ms / 1e3 / per))


def _run(steps: int, records: list[Record] | None, x: torch.Tensor, reps: int, hub: SinkHub | None) -> tuple[float, list[float]]:
    direct: list[float] = []
    t_start = time.perf_counter()
    for s in range(steps):
        for _ in range(reps):
            x @ x
        if hub is not None and records is not None:
            t0 = time.perf_counter()
            hub.write(records[s])
            direct.append(time.perf_counter() - t0)
    return time.perf_counter() - t_start, direct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--metrics", type=int, default=1000)
    ap.add_argument("--work-ms", type=float, default=20.0, help="simulated training compute per step")
    ap.add_argument("--delivery", choices=["process", "thread"], default="process")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    x, reps = _workload(args.work_ms)
    with tempfile.TemporaryDirectory() as tmp:
        now = time.time()
        records = [Record(step=s, time=now + s, scalars={f"diag/grad/norm/layer{i:04d}": float(i + s)
                                                         for i in range(args.metrics)}) for s in range(args.steps)]
        sink = MlflowSink(tracking_uri=f"sqlite:///{tmp}/mlflow.db", experiment="bench", close_timeout=900.0,
                          log_config=False, max_memory_batches=100_000, delivery=args.delivery)
        hub = SinkHub([sink])
        hub.open(RunInfo(name="bench", output_dir=Path(tmp) / "run", level="basic", config={}))
        while sink.run_id is None:  # mlflow import + store creation happen once, before training
            time.sleep(0.1)
        base, _ = _run(args.steps, None, x, reps, None)
        null_hub = SinkHub([Sink()])  # the floor: a hub whose sink does nothing, on this (shared) machine
        null_hub.open(RunInfo(name="null", output_dir=Path(tmp) / "null", level="basic", config={}))
        _, floor = _run(args.steps, records, x, reps, null_hub)
        null_hub.close("FINISHED", {})
        with_sink, direct = _run(args.steps, records, x, reps, hub)
        t0 = time.perf_counter()
        hub.close("FINISHED", {"health": "ok"}, timeout=900.0)
        drain = time.perf_counter() - t0
        sent = args.steps * args.metrics
        print(f"MLflow sink ({args.delivery} delivery), {args.metrics} metrics per logged step, {args.steps} steps, "
              f"~{args.work_ms:.0f} ms compute/step, {os.cpu_count()} CPUs")
        print(f"  training thread, direct (hub.write): mean {1e3 * statistics.mean(direct):.3f} ms/step, "
              f"p99 {1e3 * sorted(direct)[int(0.99 * (len(direct) - 1))]:.3f} ms/step   (budget < 1 ms; "
              f"same call with a do-nothing sink: mean {1e3 * statistics.mean(floor):.3f} ms)")
        print(f"  training loop slowdown (GIL + CPU contention): {1e3 * (with_sink - base) / args.steps:+.2f} ms/step "
              f"(loop {1e3 * with_sink / args.steps:.1f} vs {1e3 * base / args.steps:.1f} ms/step without sink)")
        print(f"  background delivery: {sent} points in {with_sink + drain:.1f} s -> "
              f"{sent / (with_sink + drain):.0f} points/s into SQLite (left to drain at close: {drain:.1f} s)")


if __name__ == "__main__":
    main()

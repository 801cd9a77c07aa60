"""Benchmark: a parallel Hydra sweep against a shared MLflow server on PostgreSQL, and compare from it.

1. A real PostgreSQL (``tests/_postgres.py``) and ``mlflow server --serve-artifacts`` on it.
2. The example app (a copy outside the repo, the installed trackdiag) as a ``--jobs``-job sweep,
   ``--steps`` steps each at ``+diag=advanced``, ``hydra/launcher=joblib`` with ``--workers``
   processes (or ``--launcher submitit_local``), ``MLFLOW_TRACKING_URI`` = the server.
3. Measured: the sweep's wall time; the seconds from the last job's end (its training done: the
   latest ``end_time`` in the jobs' ``run.json``) to every run final and the comparison logged to
   the parent (``.trackdiag/finalized.json``, written after the parent run is ended), checked
   against the server; points delivered / points recorded (every key of every job's local
   record against the server's metric histories); server requests per job (the server's access
   log over the sweep, the callback's work included).
4. ``--compare-runs`` synthetic runs (a 5 lr x 5 depth x 20 seed grid, 1000 steps of loss, alerts,
   the sink's tags) are logged to the server as one sweep, and ``trackdiag compare`` reads them back
   (the function and the CLI, by experiment and by parent).

    python benchmarks/sweep_server.py [--jobs 64] [--steps 500] [--workers 4] [--compare-runs 500]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _sweeps import copy_app, missing_points, start_server, stop_server, sweep_cmd, sweep_runs  # noqa: E402


def requests_logged(server: Any) -> int:
    """HTTP requests the server has logged so far (uvicorn's access log)."""
    return sum(1 for line in server.log_tail(10**9).splitlines() if '" 200' in line or '" 4' in line or '" 5' in line)


def run_sweep(server: Any, root: Path, jobs: int, steps: int, workers: int, launcher: str) -> dict[str, Any]:
    (root / "app").mkdir()
    app = copy_app(root / "app")
    sweep = root / "multirun" / "bench"
    lau = (["hydra/launcher=joblib", f"hydra.launcher.n_jobs={workers}"] if launcher == "joblib"
           else ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=60"])
    cmd, env = sweep_cmd(sweep, server.uri, "bench", "+diag=advanced", *lau, f"steps={steps}", "eval_every=100",
                         f"seed=range(0,{jobs})")
    before = requests_logged(server)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=app, env=env, capture_output=True, text=True, timeout=6 * 3600)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"sweep failed ({proc.returncode}): {proc.stderr[-3000:]}")
    during = requests_logged(server) - before
    fin = json.loads((sweep / ".trackdiag" / "finalized.json").read_text())
    ends = [json.loads(p.read_text())["end_time"] for p in sweep.glob("*/diag/run.json")]
    from mlflow import MlflowClient

    client = MlflowClient(server.uri)
    parent, kids = sweep_runs(client, "bench", sweep)
    final = all(r.info.status in ("FINISHED", "FAILED", "KILLED") for r in kids) and parent.info.status != "RUNNING"
    logged = {f.path for f in client.list_artifacts(parent.info.run_id, "trackdiag")}
    recorded = delivered = 0
    from _mlflow_util import local_points

    for r in kids:
        recorded += sum(len(v) for v in local_points(Path(r.data.tags["trackdiag.run_dir"])).values())
    missing = missing_points(client, kids)
    delivered = recorded - sum(missing.values())
    return {"jobs": jobs, "steps": steps, "workers": workers, "launcher": launcher, "sweep_wall_s": round(wall, 1),
            "last_job_end_to_all_final_and_compared_s": round(fin["time"] - max(ends), 2),
            "finalization_s": round(fin["seconds"], 2), "finalized_by": fin["trigger"],
            "children": len(kids), "all_final": final, "comparison_logged": "trackdiag/comparison.json" in logged,
            "points_recorded": recorded, "points_delivered": delivered,
            "delivered_pct": round(100.0 * delivered / max(recorded, 1), 3),
            "server_requests": during, "requests_per_job": round(during / jobs, 1)}


LRS, DEPTHS = [1e-4, 1e-3, 1e-2, 1e-1, 1.0], [2, 4, 8, 16, 32]


def log_synthetic(client: Any, eid: str, parent: str, num: int, steps: int = 1000) -> None:
    """One run as the sink would leave it: params, trackdiag tags (summary included), the loss of
    every step, an eval loss every 200 steps, alert counts; diverging at high lr / depth."""
    from mlflow.entities import Metric, Param, RunTag

    from trackdiag.sinks.mlflow.sweep import summary_tag

    rng = random.Random(num)
    lr, depth, seed = LRS[num % 5], DEPTHS[(num // 5) % 5], num // 25
    blowup = None if lr < 0.1 and depth < 32 else rng.randint(100, 900)
    alerts = {} if blowup is None else {
        "loss_divergence": {"count": 1, "first_step": blowup + 3, "severity": "critical"},
        "grad_explosion": {"count": 1, "first_step": blowup + 60, "severity": "warning"}}
    health = "critical" if alerts else "ok"
    tags = {"trackdiag.level": "basic", "trackdiag.job_num": str(num), "trackdiag.sweep": "/bench/compare500",
            "mlflow.parentRunId": parent, "trackdiag.status": "FINISHED", "trackdiag.health": health,
            "trackdiag.summary": summary_tag({"steps": steps, "health": health, "alerts": alerts}),
            **{f"trackdiag.alert.{k}": str(v["first_step"]) for k, v in alerts.items()}}
    run = client.create_run(eid, run_name=f"train-lr={lr},depth={depth},seed={seed}#{num}", tags=tags)
    loss, ts, metrics = 2.3, int(time.time() * 1000), []
    for step in range(steps):
        loss = loss * (0.997 + 0.004 * rng.random()) if blowup is None or step < blowup else loss * 1.3
        metrics.append(Metric("diag/loss", loss if loss < 1e30 else 1.7976931348623157e308, ts, step))
        if step % 200 == 199:
            metrics.append(Metric("diag/eval/loss", min(loss * 1.05, 1e300), ts, step))
    metrics += [Metric(f"diag/alerts/{k}", 1.0, ts, v["first_step"]) for k, v in alerts.items()]
    params = [Param("optimizer.lr", str(lr)), Param("model.depth", str(depth)), Param("seed", str(seed))]
    for i in range(0, len(metrics), 1000):
        client.log_batch(run.info.run_id, metrics=metrics[i:i + 1000], params=params if i == 0 else [],
                         tags=[RunTag(k, v) for k, v in tags.items()] if i == 0 else [])
    client.set_terminated(run.info.run_id, "FINISHED")


def bench_compare(server: Any, runs: int) -> dict[str, Any]:
    from mlflow import MlflowClient

    from trackdiag.compare import compare
    from trackdiag.compare.table import to_csv

    client = MlflowClient(server.uri)
    eid = client.create_experiment("compare500")
    parent = client.create_run(eid, run_name="sweep bench/compare500",
                               tags={"trackdiag.role": "sweep", "trackdiag.sweep": "/bench/compare500"}).info.run_id
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: log_synthetic(client, eid, parent, n), range(runs)))
    t1 = time.perf_counter()
    out: dict[str, Any] = {"runs": runs, "logging_s": round(t1 - t0, 1)}
    cases: list[tuple[str, dict[str, str]]] = [("by_experiment", {}), ("by_parent", {"parent": parent}),
                                               ("by_sweep_id", {"sweep": "compare500"})]
    for label, kw in cases:
        t = time.perf_counter()
        c = compare("mlflow:compare500", tracking_uri=server.uri, **kw)
        to_csv(c)
        out[f"compare_{label}_s"] = round(time.perf_counter() - t, 2)
        out[f"compare_{label}_runs"] = len(c.runs)
    out["headline"] = c.headline
    out["risk"] = c.risk_lines[:2]
    t = time.perf_counter()
    cli = subprocess.run([sys.executable, "-m", "trackdiag", "compare", "mlflow:", "--parent", parent, "--tracking-uri",
                          server.uri, "--format", "csv"], capture_output=True, text=True, timeout=1800)
    out["cli_by_parent_s"] = round(time.perf_counter() - t, 2)
    out["cli_rows"] = len(cli.stdout.splitlines()) - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=64)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--launcher", choices=("joblib", "submitit_local"), default="joblib")
    ap.add_argument("--compare-runs", type=int, default=500)
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trackdiag_sweep_bench_"))
    server = None
    results: dict[str, Any] = {}
    try:
        t = time.monotonic()
        server = start_server(root / "server")
        results["server_start_s"] = round(time.monotonic() - t, 1)
        if not args.skip_sweep:
            results["sweep"] = run_sweep(server, root, args.jobs, args.steps, args.workers, args.launcher)
            print(json.dumps(results["sweep"], indent=2), flush=True)
        if args.compare_runs:
            results["compare"] = bench_compare(server, args.compare_runs)
            print(json.dumps(results["compare"], indent=2), flush=True)
    finally:
        stop_server(server)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

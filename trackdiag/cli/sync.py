"""``trackdiag sync RUN_DIR``: deliver MLflow data a run left spooled while its tracker was down.

The MLflow sink keeps undelivered batches in ``RUN_DIR/mlflow_spool`` (and ``mlflow_spool-<n>``
for spools an earlier run in the same dir left). This replays them, oldest first, into the run
recorded in the spool (creating it if the tracker was never reached), then ends that run with
the status training ended with. Exit status: 0 all delivered, 1 some left, 2 nothing done.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="deliver MLflow data a run spooled while the tracker was unreachable")
    p.add_argument("run_dir", type=Path, help="a run's local record dir (holds mlflow_spool/), or a spool dir")
    p.add_argument("--tracking-uri", default=None, help="deliver to this MLflow store instead of the recorded one")
    p.add_argument("--force", action="store_true", help="sync even if the process that wrote the spool still runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trackdiag.sinks._mlflow_run import pid_alive
    from trackdiag.sinks._mlflow_spool import Spool, drain, spools_in

    root: Path = args.run_dir
    found = [root] if (root / "meta.json").is_file() else spools_in(root)
    if not found:
        print(f"trackdiag: nothing to sync in {root} (no mlflow_spool/: everything was delivered)")
        return 0
    rc = 0
    for path in found:
        spool = Spool(path)
        meta = spool.read_meta()
        pid = int(meta.get("pid") or 0)
        if pid and pid != os.getpid() and pid_alive(pid) and not args.force:
            print(f"trackdiag: {path} belongs to running process {pid} (still delivering it); "
                  f"wait for it to end, or pass --force if that pid is another program")
            rc = max(rc, 2)
            continue
        done, left, error = drain(spool, args.tracking_uri)
        state = spool.read_meta()["state"]
        target = f"{args.tracking_uri or state.get('tracking_uri')} run {state.get('run_id')}"
        if left:
            print(f"trackdiag: {path}: delivered {done} batch(es) to {target}; {left} left ({error}). Run again later.")
            rc = max(rc, 1)
        else:
            print(f"trackdiag: {path}: delivered {done} batch(es) to {target}")
            if spool.remove_if_done() is False:
                print(f"  some batches were rejected by MLflow for good: see {path / 'rejected.jsonl'}")
    return rc

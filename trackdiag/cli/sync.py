"""``trackdiag sync RUN_DIR``: deliver MLflow data a run left spooled while its tracker was down.

The MLflow sink keeps undelivered batches in ``RUN_DIR/mlflow_spool`` (and ``mlflow_spool-<n>``
for spools an earlier run in the same dir left). This replays them, oldest first, into the run
recorded in the spool (creating it if the tracker was never reached), then ends that run with
the status training ended with. A spool may have been written by someone else, so nothing in it
is trusted: every op is checked, only files inside the run dir the spool belongs to are uploaded
(symlinks followed), the target store is printed before anything is sent, and with
``--tracking-uri`` the data goes to that store only (a new run there; the recorded store and
artifact location are not used). Exit status: 0 all delivered, 1 some left, 2 nothing done.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sync", help="deliver MLflow data a run spooled while the tracker was unreachable")
    p.add_argument("run_dir", type=Path, help="a run's local record dir (holds mlflow_spool/), or a spool dir")
    p.add_argument("--tracking-uri", default=None,
                   help="deliver to this MLflow store (only) instead of the one recorded in the spool")
    p.add_argument("--force", action="store_true", help="sync even if the process that wrote the spool still runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from trackdiag.sinks.mlflow.check import check_state
    from trackdiag.sinks.mlflow.spool import Spool, drain, spools_in
    from trackdiag.sinks.mlflow.store import pid_alive

    root: Path = args.run_dir.resolve()
    found = [root] if (root / "meta.json").is_file() else spools_in(root)
    if not found:
        print(f"trackdiag: nothing to sync in {root} (no mlflow_spool/: everything was delivered)")
        return 0
    rc = 0
    for path in found:
        spool = Spool(path)
        try:
            meta = spool.read_meta()
        except (OSError, ValueError) as exc:
            print(f"trackdiag: {path}: unreadable meta.json ({exc}); nothing sent")
            rc = max(rc, 2)
            continue
        state = meta.get("state") if isinstance(meta, dict) else None
        problem = check_state(state, path.parent)
        if problem:
            print(f"trackdiag: {path}: refused ({problem}); nothing sent")
            rc = max(rc, 2)
            continue
        pid = meta.get("pid") if isinstance(meta.get("pid"), int) else 0
        had_lock = (path / ".lock").exists()  # spools of older versions have none: trust the pid then
        locked_by_other = not spool.claim()
        alive = not had_lock and pid and pid != os.getpid() and pid_alive(pid)
        if (locked_by_other or alive) and not args.force:
            print(f"trackdiag: {path} is being delivered by a running process (pid {pid}); "
                  f"wait for it to end, or pass --force if that pid is another program")
            rc = max(rc, 2)
            spool.release()
            continue
        from trackdiag.sinks.mlflow.spool import real_uri
        from trackdiag.util.redact import DEFAULT_POLICY

        same = real_uri(str(state.get("tracking_uri") or ""), args.tracking_uri)
        target = DEFAULT_POLICY.text(args.tracking_uri or state["tracking_uri"])  # printed without credentials
        where = "a new run" if args.tracking_uri and args.tracking_uri != same \
            else f"run {state.get('run_id') or '(new)'}"
        print(f"trackdiag: {path}: delivering to {target}, {where} (files only from {path.parent})")
        try:
            done, left, error, refused = drain(spool, args.tracking_uri)
        finally:
            state = spool.read_meta().get("state") or {}
        for why in refused[:5]:
            print(f"  refused: {why}")
        if len(refused) > 5:
            print(f"  ... {len(refused) - 5} more refused (see {path / 'rejected.jsonl'})")
        if left:
            print(f"trackdiag: {path}: delivered {done} op(s) to {target} run {state.get('run_id')}; "
                  f"{left} left ({error}). Run again later.")
            rc = max(rc, 1)
        else:
            print(f"trackdiag: {path}: delivered {done} op(s) to {target} run {state.get('run_id')}")
            if spool.remove_if_done() is False:
                print(f"  some ops were refused or rejected by MLflow for good: see {path / 'rejected.jsonl'}")
        spool.release()
    return rc

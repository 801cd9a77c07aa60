"""Spools earlier runs left behind, delivered in the background by a later session on the same store.

When a session's MLflow run exists, the sink looks (once, on its delivery thread) for
``mlflow_spool*`` dirs under the session's output root (:func:`output_root`: e.g. ``<cwd>/outputs``
for Hydra runs, ``<cwd>/trackdiag_runs`` without Hydra; at most 6 levels deep, 20,000 dirs:
~10 ms for a thousand runs) that name *this session's* tracking store. If there are any, it starts
this module as a child process (low priority, its own process group), which takes each spool's
lock (skipping spools a live process is delivering) and delivers it exactly as ``trackdiag sync`` does (``_mlflow_spool.drain``: every op
checked, only files inside the spool's run dir, never another store or artifact location). It
prints one line when it finds something and one when done. The session ends it at close with
SIGTERM: it stops between two groups and keeps the rest spooled for the next session or sync.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger("trackdiag")

MAX_DEPTH = 6
MAX_DIRS = 20_000


def output_root(run_dir: Path, cwd: Path) -> Path:
    """The tree whose spools a session looks at: the first dir below ``cwd`` that holds the run
    dir (``outputs``, ``multirun``, ``trackdiag_runs``...), else the run dir's parent."""
    try:
        rel = Path(os.path.realpath(run_dir)).relative_to(os.path.realpath(cwd))
    except ValueError:
        return run_dir.parent
    return Path(cwd) / rel.parts[0] if len(rel.parts) > 1 else run_dir.parent


def find(root: Path, exclude: set[Path]) -> list[Path]:
    """Spool dirs (with a ``meta.json``) under ``root``, oldest first, not in ``exclude``."""
    found: list[Path] = []
    seen = 0
    skip = {Path(os.path.realpath(p)) for p in exclude}
    stack: list[tuple[Path, int]] = [(root, 0)]
    while stack and seen < MAX_DIRS:
        d, depth = stack.pop()
        seen += 1
        try:
            entries = [e for e in os.scandir(d) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
        except OSError:
            continue
        for e in entries:
            p = Path(e.path)
            if e.name.startswith("mlflow_spool"):
                if (p / "meta.json").is_file() and Path(os.path.realpath(p)) not in skip:
                    found.append(p)
            elif depth + 1 < MAX_DEPTH:
                stack.append((p, depth + 1))
    return sorted(found, key=lambda p: (p / "meta.json").stat().st_mtime)


def deliver(root: Path, tracking_uri: str, exclude: set[Path], stop: Any = lambda: False) -> list[str]:
    """Deliver every leftover spool under ``root`` that names ``tracking_uri``; one line per spool."""
    from trackdiag.sinks.mlflow.spool import Spool, drain

    spools = [p for p in find(root, exclude) if _names(p, tracking_uri)]
    if not spools:
        return []
    from trackdiag.util.redact import DEFAULT_POLICY

    log.warning("trackdiag: delivering %d MLflow spool(s) that earlier runs left under %s to %s, in the background",
                len(spools), root, DEFAULT_POLICY.text(tracking_uri))
    lines = []
    for path in spools:
        if stop():
            break
        spool = Spool(path)
        if not spool.claim():
            continue  # another process (its own session, sync, a sibling job) is delivering it
        try:
            done, left, error, refused = drain(spool, tracking_uri, should_stop=stop)  # the store they name
            note = f", {len(refused)} refused" if refused else ""
            if left:
                lines.append(f"{path}: {done} delivered, {left} left ({error}){note}")
            else:
                lines.append(f"{path}: {done} delivered{note}")
                spool.remove_if_done()
        except Exception as exc:  # one bad spool must not stop the others
            lines.append(f"{path}: not delivered ({type(exc).__name__}: {exc})")
        finally:
            spool.release()
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="deliver MLflow spools earlier runs left (used by the MLflow sink)")
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--tracking-uri", default=os.environ.get("TRACKDIAG_TRACKING_URI"))
    ap.add_argument("--exclude", type=Path, action="append", default=[])
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    if hasattr(os, "nice"):
        os.nice(10)  # background work: the training process comes first
    if not args.tracking_uri:
        ap.error("--tracking-uri (or TRACKDIAG_TRACKING_URI) is required")
    lines = deliver(args.root, args.tracking_uri, set(args.exclude), stop=lambda: bool(stopping))
    if lines:
        left = [x for x in lines if " left " in x or "not delivered" in x]
        log.warning("trackdiag: earlier MLflow spools: %d delivered%s", len(lines) - len(left),
                    f", {len(left)} not finished (the next session or `trackdiag sync` delivers them): "
                    + "; ".join(left) if left else "")
    return 0


def launch(root: Path, tracking_uri: str, exclude: Path) -> Any:
    """If spools for ``tracking_uri`` lie under ``root`` (a bounded scan, here), start their
    delivery: this module as a child process in its own process group, at low priority. Returns
    the ``Popen``, or None when there is nothing to do (or it could not start)."""
    import subprocess

    from trackdiag.sinks.mlflow.worker import child_command

    if not [p for p in find(root, {exclude}) if _names(p, tracking_uri)]:
        return None
    env = dict(os.environ)
    env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "60")
    env["TRACKDIAG_TRACKING_URI"] = tracking_uri  # not on the command line: ps would show its credentials
    cmd = child_command("trackdiag.sinks.mlflow.leftovers", "--root", str(root), "--exclude", str(exclude))
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError as exc:
        log.debug("trackdiag: background delivery of earlier spools not started: %s", exc)
        return None


def _names(spool: Path, tracking_uri: str) -> bool:
    """Whether the spool's ``meta.json`` names ``tracking_uri``."""
    try:
        state = json.loads((spool / "meta.json").read_text(encoding="utf-8")).get("state") or {}
    except (OSError, ValueError, AttributeError):
        return False
    from trackdiag.util.redact import DEFAULT_POLICY

    stored = state.get("tracking_uri") if isinstance(state, dict) else None
    return isinstance(stored, str) and stored in (tracking_uri, DEFAULT_POLICY.text(tracking_uri))


def stop(proc: Any, grace: float = 10.0) -> None:
    """End a :func:`launch` child: SIGTERM (it stops between two groups), then kill its group."""
    if proc is None or proc.poll() is not None:
        return
    import subprocess

    try:
        proc.terminate()
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(5)


if __name__ == "__main__":
    sys.exit(main())

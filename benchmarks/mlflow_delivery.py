"""Calls and seconds to deliver a whole run to MLflow: the example app, 300 steps, ``+diag=advanced``.

Each case runs ``examples/train.py`` as a user would (a copy in a fresh temp dir, a Hydra job) and
reports, from outside the job:

- ``calls``: MLflow client calls the job made (every process: the training process, the delivery
  worker), counted by a ``sitecustomize`` hook that wraps ``MlflowClient`` methods and the
  artifact repositories' uploads; ``writes`` are the calls that send data (log_batch,
  log_artifact(s), log_image, set_terminated, ...). For the server case also the HTTP requests the
  proxy saw.
- ``mlflow_close_s``: seconds the MLflow sink's ``close`` took (waiting for delivery at the end);
  ``close_s``: seconds from the local record's end (``run.json`` ``end_time``, written when the
  sinks start closing) to the job's exit (the interpreter's own exit is ~1.3 s of it here).
- ``job s``: the job's wall time. ``status``: the run's status in MLflow after the job, and
  ``points``: (key, step) points in MLflow / in the local record.
- ``sync``: if the job left a spool, ``trackdiag sync`` is run and its seconds and calls reported.

Cases: ``sqlite`` (the default store, created by the run: no ``MLFLOW_TRACKING_URI``),
``busy`` (the same with two busy processes beside the job), ``server`` (a real ``mlflow server``
on 127.0.0.1 behind a proxy adding ``--delay`` s to every request), ``sync`` (the job's store does
not answer, so all of it is spooled; then ``trackdiag sync --tracking-uri`` to the server behind
the proxy). Usage::

    python benchmarks/mlflow_delivery.py [--cases sqlite,busy,server] [--delay 0.15] [--src DIR]

``--src`` puts another checkout's trackdiag first on ``PYTHONPATH`` (to measure older code).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from _delay_proxy import DelayProxy  # noqa: E402
from _mlflow_util import MlflowServer, free_port  # noqa: E402

HOOK = r'''
import os, sys, threading, importlib.abc, importlib.util
_LOG = os.environ.get("BENCH_CALLS_FILE")
_WRITES = {"log_batch", "log_metric", "log_param", "set_tag", "log_artifact", "log_artifacts", "log_image",
           "set_terminated", "update_run", "create_run", "create_experiment", "set_experiment_tag"}
_local = threading.local()

def _wrap(owner, name, label):
    fn = getattr(owner, name, None)
    if fn is None or getattr(fn, "_bench", False):
        return
    def wrapper(*a, **k):
        depth = getattr(_local, "depth", 0)
        if depth == 0 and _LOG:
            with open(_LOG, "a") as f:
                f.write(f"{os.getpid()} {label} {__import__('time').time():.3f}\n")
        _local.depth = depth + 1
        try:
            return fn(*a, **k)
        finally:
            _local.depth = depth
    wrapper._bench = True
    setattr(owner, name, wrapper)

def _timed(owner, name):
    fn = getattr(owner, name)
    def wrapper(*a, **k):
        import time
        t0 = time.time()
        try:
            return fn(*a, **k)
        finally:
            if _LOG:
                with open(_LOG, "a") as f:
                    f.write(f"{os.getpid()} close_seconds {time.time() - t0:.3f}\n")
    setattr(owner, name, wrapper)

_TARGETS = {
    "mlflow.tracking.client": ("MlflowClient", None),
    "trackdiag.sinks.mlflow.sink": ("MlflowSink", "close"),
    "mlflow.store.artifact.local_artifact_repo": ("LocalArtifactRepository", ("log_artifact", "log_artifacts")),
    "mlflow.store.artifact.http_artifact_repo": ("HttpArtifactRepository", ("log_artifact", "log_artifacts")),
}

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        orig = loader.exec_module
        def exec_module(module):
            orig(module)
            cls_name, methods = _TARGETS[name]
            cls = getattr(module, cls_name)
            if methods == "close":
                _timed(cls, "close")
                return
            names = methods or [m for m in vars(cls) if not m.startswith("_") and callable(vars(cls)[m])]
            for m in names:
                _wrap(cls, m, ("repo." if methods else "") + m)
        loader.exec_module = exec_module
        return spec

if _LOG:
    sys.meta_path.insert(0, _Finder())
'''


def _busy(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def _points_in_mlflow(uri: str, run_dir: Path) -> tuple[str, int, int, str]:
    """(status, points in MLflow, points in the local record, run id) for the job's run."""
    from mlflow import MlflowClient

    from trackdiag.core.record import Record
    from trackdiag.sinks.mlflow.ops import sanitize_key

    local: dict[str, set[int]] = {}
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        for k, s, _ in Record.from_json(line).points():
            local.setdefault(k, set()).add(s)
    client = MlflowClient(uri)
    exps = [e.experiment_id for e in client.search_experiments()]
    runs = [r for r in client.search_runs(exps) if r.data.tags.get("trackdiag.run_dir") == str(run_dir)]
    if not runs:
        return "NO RUN", 0, sum(map(len, local.values())), ""
    run = runs[0]
    found = sum(len(local[k] & {m.step for m in client.get_metric_history(run.info.run_id, sanitize_key(k))})
                for k in local)
    return run.info.status, found, sum(map(len, local.values())), run.info.run_id


def run_case(case: str, delay: float, src: Path | None, steps: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix=f"trackdiag-bench-{case}-"))
    app = tmp / "app"
    shutil.copytree(REPO / "examples", app)
    hook = tmp / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    calls_file = tmp / "calls.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join(([str(src)] if src else []) + [str(hook)])
    env["BENCH_CALLS_FILE"] = str(calls_file)
    server = proxy = None
    busy: list[subprocess.Popen[bytes]] = []
    out: dict[str, Any] = {"case": case}
    try:
        if case in ("server", "sync"):
            server = MlflowServer(tmp)
            server.start()
            server.wait(120)
            proxy = DelayProxy(server.uri, free_port(), delay, log=tmp / "proxy.log")
            proxy.start()
            env["MLFLOW_TRACKING_URI"] = proxy.uri if case == "server" else f"http://127.0.0.1:{free_port()}"
            uri = server.uri
        else:
            uri = f"sqlite:///{app / 'mlflow.db'}"
        if case == "busy":
            busy = _busy(2)
        run_dir = tmp / "out"
        t0 = time.time()
        extra = ["diag.sink.mlflow.close_timeout=1"] if case == "sync" else []  # nothing answers: spool it all
        proc = subprocess.run([sys.executable, "train.py", "+diag=advanced", f"steps={steps}",
                               f"hydra.run.dir={run_dir}", *extra], cwd=app, env=env, capture_output=True, text=True,
                              timeout=1200)
        t1 = time.time()
        _kill(busy)
        busy = []
        diag = run_dir / "diag"
        meta = json.loads((diag / "run.json").read_text())
        out["job_s"] = round(t1 - t0, 1)
        out["close_s"] = round(t1 - float(meta.get("end_time") or t1), 1)
        out["rc"] = proc.returncode
        lines = calls_file.read_text().splitlines() if calls_file.exists() else []
        out["mlflow_close_s"] = sum(float(x.split()[2]) for x in lines if " close_seconds " in x)
        calls = Counter(line.split(" ")[1] for line in lines if " close_seconds " not in line)
        out["calls"] = sum(calls.values())
        out["writes"] = sum(v for k, v in calls.items() if k.split(".")[-1] in (
            "log_batch", "log_metric", "log_param", "set_tag", "log_artifact", "log_artifacts", "log_image",
            "set_terminated", "update_run", "create_run", "create_experiment", "set_experiment_tag"))
        out["by_method"] = dict(calls.most_common())
        if proxy is not None:
            reqs = proxy.requests()
            out["http_requests"] = len(reqs)
            out["http_by"] = dict(Counter(" ".join(r.split("?")[0].split("/")[:6]) if "/artifacts/" not in r
                                          else r.split(" ")[0] + " artifact" for r in reqs).most_common())
        out["tail"] = [x for x in proc.stderr.splitlines() if "trackdiag" in x and ("MLflow" in x or "deliver" in x)][-4:]
        status, found, local, _ = _points_in_mlflow(uri, diag)
        out.update(status=status, points=f"{found}/{local}")
        spools = sorted(diag.glob("mlflow_spool*"))
        if spools and any((s / "meta.json").exists() for s in spools):
            calls_file.unlink(missing_ok=True)
            t2 = time.time()
            target = ["--tracking-uri", proxy.uri] if case == "sync" and proxy is not None else []
            sync = subprocess.run([sys.executable, "-m", "trackdiag", "sync", str(diag), *target], cwd=app, env=env,
                                  capture_output=True, text=True, timeout=1200)
            out["sync_s"] = round(time.time() - t2, 1)
            out["sync_calls"] = len(calls_file.read_text().splitlines()) if calls_file.exists() else 0
            if proxy is not None:
                out["sync_http_requests"] = len(proxy.requests()) - out.get("http_requests", 0)
            out["sync_rc"] = sync.returncode
            status, found, local, _ = _points_in_mlflow(uri, diag)
            out.update(status_after_sync=status, points_after_sync=f"{found}/{local}")
    finally:
        _kill(busy)
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="sqlite,busy,server")
    ap.add_argument("--delay", type=float, default=0.15, help="seconds the proxy adds to every request (server case)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--src", type=Path, default=None, help="a trackdiag checkout to put first on PYTHONPATH")
    args = ap.parse_args()
    for case in args.cases.split(","):
        result = run_case(case, args.delay, args.src, args.steps)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

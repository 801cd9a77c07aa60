"""The example app on a busy machine with the embedded MLflow store created by that very run: as many busy
processes beside the job as the machine has idle cores (their own process group, killed at the end; none while
the full suite keeps every core busy already, two on an idle 2-core machine), no MLFLOW_TRACKING_URI.
The run must end FINISHED in MLflow with every (key, step) point of the local record."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from trackdiag.sinks.mlflow.ops import sanitize_key  # noqa: E402

import _warm as warm
from _mlflow_util import history, local_points  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def idle_cores() -> int:
    """The cores nothing runs on, from the 1-minute load average (0 while the full suite runs: ~3-6 on 2 cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores - round(os.getloadavg()[0]))


def test_busy_machine_fresh_default_store(tmp_path: Path) -> None:
    app = tmp_path / "app"
    shutil.copytree(REPO / "examples", app)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    spin = idle_cores()  # issue 47: two spinners beside a suite that saturates the cores burnt ~12 CPU-s for nothing
    busy = subprocess.Popen([sys.executable, "-c", "import os\nfor _ in range(%d):\n    if os.fork() == 0: break\n"
                             "while True: pass" % (spin - 1)], start_new_session=True) if spin else None
    try:
        t0 = time.monotonic()
        proc = warm.run([sys.executable, "train.py", "+diag=advanced", "steps=100",
                               f"hydra.run.dir={tmp_path / 'out'}"], cwd=app, env=env, capture_output=True, text=True,
                        timeout=900)
        wall = time.monotonic() - t0
    finally:
        if busy is not None:
            os.killpg(busy.pid, signal.SIGKILL)  # every busy process: one group
            busy.wait(10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (app / "mlflow.db").exists()  # the default store, made by this run
    run_dir = tmp_path / "out" / "diag"
    client = MlflowClient(f"sqlite:///{app / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert run.info.status == "FINISHED", proc.stderr[-3000:]
    for key, points in local_points(run_dir).items():
        stored = {s for s, _ in history(client, run.info.run_id, sanitize_key(key))}
        assert {s for s, _ in points} <= stored, key
    assert not (run_dir / "mlflow_spool").exists()
    # what the MLflow UI shows: the model-training view, and the user's script as the Source
    exp = client.get_experiment_by_name("train")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["mlflow.source.name"] == str(app / "train.py")
    print(f"\nbusy machine ({spin} busy processes beside the job), fresh store: job {wall:.1f}s")

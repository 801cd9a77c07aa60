"""What the MLflow UI shows of trackdiag's runs, on real stores: the experiment's view
(``mlflow.experimentKind``), the run's Source (the user's script and its git commit, not the
delivery worker), a Hydra sweep's comparison in its parent run with the default store, and end-of-run
commands that work when pasted into a shell without the venv."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

import _warm as warm
from _mlflow_util import free_port, ready_store, tiny_model, train  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KIND = "mlflow.experimentKind"


def _run(tmp_path: Path, store: str, experiment: str, name: str) -> str:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / name),
                                 sink={"mlflow": {"tracking_uri": store, "experiment": experiment, "delivery": "thread"}})
    with diag:
        train(diag, model, opt, range(3))
    return str(next(s for s in diag._hub.sinks if isinstance(s, MlflowSink)).run_id)


def test_experiment_kind_set_but_never_overwritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = ready_store(tmp_path)
    client = MlflowClient(store)
    client.create_experiment("users-genai", tags={KIND: "genai_development"})
    client.create_experiment("users-untagged")
    for exp in ("fresh", "users-genai", "users-untagged"):
        _run(tmp_path, store, exp, exp)
    kinds = {e: client.get_experiment_by_name(e).tags.get(KIND) for e in ("fresh", "users-genai", "users-untagged")}
    assert kinds == {"fresh": "custom_model_development", "users-genai": "genai_development",
                     "users-untagged": "custom_model_development"}


SCRIPT = """
import torch
from torch import nn
import trackdiag
model = nn.Sequential(nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir="run",
                           sink={"mlflow": {"tracking_uri": STORE, "experiment": "source"}}) as diag:
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean(); loss.backward(); opt.step(); opt.zero_grad(); diag.step(loss)
"""


def test_source_is_the_users_script_and_its_commit(tmp_path: Path) -> None:
    """The run's Source is the user's entry script (not ``_mlflow_worker.py``), with the commit of
    the user's repository (run from another dir, by relative path)."""
    repo = tmp_path / "project"
    repo.mkdir()
    store = ready_store(tmp_path)
    (repo / "train_gan.py").write_text(SCRIPT.replace("STORE", repr(store)))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for cmd in (["init", "-q"], ["add", "train_gan.py"], ["commit", "-qm", "init"]):
        subprocess.run(git + cmd, cwd=repo, check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = warm.run([sys.executable, "project/train_gan.py"], cwd=tmp_path, env=env, capture_output=True,
                    text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("source").experiment_id])
    tags = run.data.tags
    assert tags["mlflow.source.name"] == str(repo / "train_gan.py") and tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.source.git.commit"] == head


def _mlflow_ui_healthy(cmd: str, env: dict[str, str]) -> bool:
    """Start a printed ``mlflow ui`` command (own process group, a free port), wait for /health, kill it."""
    port = free_port()
    proc = subprocess.Popen(f"{cmd} --host 127.0.0.1 --port {port}", shell=True, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120 and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                time.sleep(0.3)
        return False
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)


@pytest.mark.slow
def test_sweep_with_default_store_and_commands_that_work_when_pasted(tmp_path: Path) -> None:
    """A two-job multirun of the example with the embedded default store: the comparison is in the
    sweep's parent run; the commands each job prints run in a shell whose PATH has no venv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    ready_store(tmp_path)  # the default store's file, in the launch dir (its tables made already)
    proc = warm.run([sys.executable, str(REPO / "examples" / "train.py"), "-m", "+diag=basic", "steps=20",
                           "eval_every=10", "seed=0,1", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path,
                    env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("train")
    [parent] = client.search_runs([exp.experiment_id], "tags.`trackdiag.role` = 'sweep'")
    files = {f.path for f in client.list_artifacts(parent.info.run_id, "trackdiag")}
    assert {"trackdiag/comparison.html", "trackdiag/comparison.csv"} <= files, proc.stderr[-2000:]
    summary = [line.split("to look again:", 1)[1].strip() for line in proc.stderr.splitlines() if "to look again:" in line]
    ui = [line.split("start the UI first:", 1)[1].strip() for line in proc.stderr.splitlines()
          if "start the UI first:" in line]
    assert len(summary) == 2 and len(ui) == 2, proc.stderr[-3000:]
    clean = {"PATH": "/usr/bin:/bin", "HOME": env.get("HOME", str(tmp_path)), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    done = subprocess.run(summary[0], shell=True, env=clean, capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0 and "trackdiag: 20 steps, health" in done.stdout, done.stderr
    assert shlex.split(ui[0])[1:4] == ["-m", "mlflow", "ui"]
    assert _mlflow_ui_healthy(ui[0], clean)

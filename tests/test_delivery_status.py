"""Status is the truth: a script that dies after ``Diagnostics(...)`` without ``with`` (the session
closes at exit) is FAILED in run.json, the console summary, MLflow and W&B; KeyboardInterrupt and
SIGTERM are KILLED; a crashed Hydra job (with or without ``with``) is shown as failed, never
"health OK". Real scripts in subprocesses, a real SQLite store, W&B offline read back."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import _warm as warm  # noqa: E402
from _mlflow_util import ready_store  # noqa: E402
from wandb_reader import read_run, settled_runs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys, time, torch
from torch import nn
import trackdiag

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
diag = trackdiag.Diagnostics(model, opt, level="basic", every=2, sinks=SINKS, output_dir=OUT, hparams={"lr": 0.05},
                             sink={"mlflow": {"tracking_uri": STORE, "experiment": "status"},
                                   "wandb": {"mode": "offline", "dir": WANDB, "project": "status"}})
step = 0
while True:  # the README's form for loops without `with`: diag.close() at the end, never reached here
    x = torch.randn(16, 8)
    loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,)))
    loss.backward(); opt.step(); opt.zero_grad()
    diag.step(loss)
    step += 1
    if step == 5:
        open(OUT + ".ready", "w").close()
        END
    if step >= 2000:
        break
    time.sleep(0.01)
diag.close()
"""


def _start(tmp_path: Path, end: str, sinks: list[str]) -> tuple[subprocess.Popen[str], Path, str]:
    """Start the script (own process group) with its own ready store; returns (process, run dir, store)."""
    out = tmp_path / "run"
    store = ready_store(tmp_path)
    code = SCRIPT.replace("SINKS", repr(sinks)).replace("OUT", repr(str(out))).replace("STORE", repr(store)) \
        .replace("WANDB", repr(str(tmp_path))).replace("END", end)
    (tmp_path / "script.py").write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    proc = warm.popen([sys.executable, "script.py"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True, start_new_session=True)
    return proc, out, store


def _finish(proc: subprocess.Popen[str], out: Path, sigterm: bool = False) -> tuple[int, str]:
    """(exit code, stderr); with ``sigterm``, SIGTERM once the script reached step 5."""
    try:
        if sigterm:
            t0 = time.monotonic()
            while not Path(str(out) + ".ready").exists() and time.monotonic() - t0 < 120:
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, stderr


def _mlflow_run(store: str, out: Path) -> Any:
    client = MlflowClient(store)
    [run] = client.search_runs([client.get_experiment_by_name("status").experiment_id],
                               f"tags.`trackdiag.run_dir` = '{out}'")
    return run


@pytest.mark.slow
def test_crash_sigterm_and_ctrl_c_without_with(tmp_path: Path) -> None:
    """Three scripts at once: an exception (FAILED everywhere: run.json, console, MLflow, W&B),
    SIGTERM and KeyboardInterrupt (KILLED; SIGTERM exits 143)."""
    started = {
        "crash": _start(tmp_path / "crash", 'raise RuntimeError("GAN blew up at step 5")',
                        ["local", "console", "mlflow", "wandb"]),
        "sigterm": _start(tmp_path / "sigterm", "time.sleep(60)", ["local", "console", "mlflow"]),
        "ctrl_c": _start(tmp_path / "ctrl_c", "raise KeyboardInterrupt", ["local", "console", "mlflow"]),
    }
    done = {name: _finish(proc, out, sigterm=name == "sigterm") for name, (proc, out, _) in started.items()}

    rc, err = done["crash"]
    _, out, store = started["crash"]
    assert rc == 1 and "GAN blew up at step 5" in err  # the traceback still prints
    (crash,) = json.loads((out / "alerts.json").read_text())  # sys.excepthook -> the close at exit
    assert crash["kind"] == "crash" and crash["step"] == 5 and "GAN blew up" in crash["message"]
    assert json.loads((out / "run.json").read_text())["status"] == "FAILED"
    assert json.loads((out / "summary.json").read_text())["status"] == "FAILED"
    assert "run FAILED" in err and "health OK" not in err, err[-2000:]
    run = _mlflow_run(store, out)
    assert run.info.status == "FAILED"
    assert run.data.tags["trackdiag.status"] == "FAILED" and run.data.tags["trackdiag.health"] == "failed"
    [wandb_file] = settled_runs(tmp_path / "crash")
    wb = read_run(wandb_file)
    assert wb.exit_code == 1 and wb.summary["trackdiag/status"] == "FAILED"
    assert wb.summary["trackdiag/health"] == "failed"

    for name in ("sigterm", "ctrl_c"):
        rc, err = done[name]
        _, out, store = started[name]
        if name == "sigterm":
            assert rc == 128 + signal.SIGTERM, err[-2000:]
        assert json.loads((out / "run.json").read_text())["status"] == "KILLED", name
        assert "run KILLED" in err, (name, err[-2000:])
        run = _mlflow_run(store, out)
        assert run.info.status == "KILLED" and run.data.tags["trackdiag.health"] == "killed", name


def test_status_of_exceptions_and_close_inside_except(tmp_path: Path) -> None:
    """Without an explicit status, close() called while an exception is handled is FAILED."""
    import trackdiag
    from trackdiag.util import exit_status
    from _mlflow_util import tiny_model, train

    assert exit_status.status_of(None) == "FINISHED" and exit_status.status_of(ValueError()) == "FAILED"
    assert exit_status.status_of(KeyboardInterrupt()) == "KILLED"
    assert exit_status.status_of(SystemExit(0)) == "FINISHED" and exit_status.status_of(SystemExit(2)) == "FAILED"
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path / "r"))
    try:
        train(diag, model, opt, range(3))
        raise OSError("disk full")
    except OSError:
        diag.close()
    assert json.loads((tmp_path / "r" / "run.json").read_text())["status"] == "FAILED"
    with pytest.raises(ValueError, match="not one of FINISHED, FAILED, KILLED"):
        trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path / "s")).close("DONE")


USER_APP = """
import hydra, torch
from torch import nn
import trackdiag

@hydra.main(version_base=None, config_path=None)
def main(cfg):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diag = trackdiag.Diagnostics.from_config(cfg.get("diag"), model=model, optimizer=opt, hparams=cfg)
    for step in range(40):  # no `with`, and the crash skips diag.close()
        loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
        loss.backward(); opt.step(); opt.zero_grad()
        diag.step(loss)
        if step == 20:
            raise RuntimeError("planted crash at step 20")
    diag.close()

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_crashed_hydra_jobs_are_failed_not_healthy(tmp_path: Path) -> None:
    """The example with fault=crash (``with diag``) and a user's app without ``with``: both jobs are
    FAILED in run.json and MLflow (health tag ``failed``) and the console says so."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    runs = {
        "example": [str(REPO / "examples" / "train.py"), "+diag=basic", "fault=crash", "fault_step=30", "steps=60"],
        "user": ["user_app.py", "+diag=basic"],
    }
    procs = {}
    for name, cmd in runs.items():  # both at once, each launched from its own dir (its own default store)
        (tmp_path / name).mkdir()
        (tmp_path / name / "user_app.py").write_text(USER_APP)
        ready_store(tmp_path / name)  # mlflow.db in the launch dir: the default store, tables made already
        procs[name] = warm.popen([sys.executable, *cmd, f"hydra.run.dir={tmp_path / name / 'out'}",
                                        "hydra.job.name=crash"], cwd=tmp_path / name, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    for name, proc in procs.items():
        try:
            _, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        out = tmp_path / name / "out"
        assert proc.returncode == 1 and "planted crash" in stderr, stderr[-3000:]
        assert json.loads((out / "diag" / "run.json").read_text())["status"] == "FAILED", name
        crash = json.loads((out / "diag" / "alerts.json").read_text())[-1]  # the flight recorder's finding
        assert crash["kind"] == "crash" and "RuntimeError: planted crash" in crash["message"], (name, crash)
        assert "run FAILED" in stderr and "health OK" not in stderr, (name, stderr[-2000:])
        client = MlflowClient(f"sqlite:///{tmp_path / name / 'mlflow.db'}")  # the default store
        [run] = client.search_runs([client.get_experiment_by_name("crash").experiment_id],
                                   f"tags.`trackdiag.run_dir` = '{out / 'diag'}'")
        assert run.info.status == "FAILED" and run.data.tags["trackdiag.health"] == "failed", name
        assert run.data.tags["trackdiag.status"] == "FAILED"


def test_sigterm_after_the_last_session_closed_is_the_default(tmp_path: Path) -> None:
    """Once every session is closed, SIGTERM does what it did before trackdiag: the process dies of
    the signal, without a SystemExit raised into whatever runs then (a pool worker's atexit hooks)."""
    script = textwrap.dedent(f"""
        import os, signal, time, torch
        import trackdiag
        model = torch.nn.Linear(2, 2)
        with trackdiag.Diagnostics(model, None, level="basic", sinks=["local"], output_dir={str(tmp_path / "run")!r}):
            model(torch.randn(3, 2)).sum().backward()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
        print("survived")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = warm.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                    timeout=120)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert "SystemExit" not in proc.stderr and "survived" not in proc.stdout

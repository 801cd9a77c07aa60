"""``+diag=<preset>`` in a user's own Hydra app outside the repo, using the installed package."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _warm as warm

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Path:
    """A copy of the example app in a temp dir: the user's own project, not ours."""
    d = tmp_path_factory.mktemp("userapp")
    shutil.copy(REPO / "examples" / "train.py", d / "train.py")
    shutil.copytree(REPO / "examples" / "conf", d / "conf")
    return d


def run_app(app: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    return warm.run([sys.executable, "train.py", *overrides], cwd=app, env=env, capture_output=True,
                    text=True, timeout=300)


def test_installed_package_is_used(app: Path) -> None:
    out = warm.run([sys.executable, "-c", "import trackdiag, hydra_plugins.trackdiag_searchpath as p; print(trackdiag.__file__)"],
                   cwd=app, capture_output=True, text=True, check=True)
    assert "site-packages" in out.stdout, out.stdout
    installed = Path(out.stdout.strip()).parent
    stale = [str(f.relative_to(REPO / "trackdiag")) for f in (REPO / "trackdiag").rglob("*")
             if f.suffix in (".py", ".yaml") and "__pycache__" not in f.parts
             and (not (installed / f.relative_to(REPO / "trackdiag")).exists()
                  or (installed / f.relative_to(REPO / "trackdiag")).read_bytes() != f.read_bytes())]
    assert not stale, f"installed trackdiag is stale (run scripts/bootstrap.sh): {stale[:5]}"


def test_advanced_preset_with_overrides_healthy_300_steps(app: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    proc = run_app(app, "+diag=advanced", "diag.every=20", "diag.rules.grad_explosion.threshold=50",
                   "diag.sinks=[local,console]", f"hydra.run.dir={out_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    diag_dir = out_dir / "diag"
    run = json.loads((diag_dir / "run.json").read_text())
    assert run["status"] == "FINISHED" and run["level"] == "advanced"
    assert run["config"]["every"] == 20 and run["config"]["rules"]["grad_explosion"]["threshold"] == 50
    assert run["hparams"]["optimizer"]["lr"] == pytest.approx(1e-3)
    summary = json.loads((diag_dir / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["alerts"] == {} and summary["health"] == "ok"
    recs = [json.loads(line) for line in (diag_dir / "records.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if "diag/loss" in r["series"]]  # logging steps (evaluations aside)
    # the first 10 steps one by one (update ratios), then every 20 (and the every-50 probes' steps)
    assert steps[:14] == [*range(10), 20, 40, 50, 60]


def test_planted_nan_fires_through_hydra(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "+diag=basic", "fault=nan_input", "fault_step=123", "steps=150", "diag.sinks=[local]",
                   f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "diag" / "summary.json").read_text())
    assert summary["alerts"]["nonfinite_loss"]["first_step"] == 123


def test_without_diag_the_same_app_runs_disabled(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "steps=20", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "diag").exists()


@pytest.mark.parametrize("overrides,needle", [
    (["+diag=advanced", "diag.level=nosuch"], "diag.level: unknown preset 'nosuch'"),
    (["+diag=advanced", "+diag.bogus=1", "diag.every=0"], "diag.bogus: unknown key"),
    (["+diag=advanced", "diag.rules.grad_explosion.action=explode"], "'explode' is not one of"),
])
def test_bad_config_fails_with_config_error_before_training(app: Path, tmp_path: Path, overrides, needle) -> None:
    proc = run_app(app, *overrides, f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "ConfigError" in proc.stderr and needle in proc.stderr, proc.stderr[-3000:]
    assert "step 49" not in proc.stderr + proc.stdout  # nothing trained
    if "diag.every=0" in overrides:
        assert "diag.every: must be >= 1" in proc.stderr  # both problems in one error


def test_unknown_preset_is_named_by_hydra(app: Path, tmp_path: Path) -> None:
    proc = run_app(app, "+diag=nosuch", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "diag/nosuch" in proc.stderr and "advanced" in proc.stderr and "basic" in proc.stderr

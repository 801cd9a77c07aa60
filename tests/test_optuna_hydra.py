"""Issue 46 (b): ``hydra/sweeper=trackdiag_optuna`` with ``diag.sweep.stop_on=[critical]`` in a user's own
Hydra app (the example app copied outside the repo), run in a subprocess: 8 trials over the SGD learning
rate whose top explodes, on an SQLite Optuna storage (PostgreSQL: tests/test_optuna_stop.py).

Exploding trials end early and are PRUNED with the alert as the reason; healthy ones are COMPLETE with
the job's return value; the best trial is a healthy one; the sweep's comparison and its MLflow parent run
count the stops. The subprocess imports trackdiag and the plugin from this checkout (PYTHONPATH), so the
test does not depend on the installed copy being fresh.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import _warm as warm

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LRS = [0.001, 0.01, 0.1, 1.0, 10.0, 100.0, 10000.0, 100000.0]
STEPS = 40


def test_optuna_sweeper_prunes_exploding_trials(tmp_path: Path) -> None:
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(REPO / "examples" / "train.py", app / "train.py")
    shutil.copytree(REPO / "examples" / "conf", app / "conf")
    sweep = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    cmd = [sys.executable, "train.py", "-m", "hydra/sweeper=trackdiag_optuna", "hydra.sweeper.sampler=grid",
           f"hydra.sweeper.n_trials={len(LRS)}", "hydra.sweeper.n_jobs=2", f"optimizer.lr=choice({','.join(map(str, LRS))})",
           "optimizer.name=sgd", f"steps={STEPS}", "eval_every=10", "+diag=basic", "diag.sinks=[local]", "diag.every=5",
           "diag.budget=null", "diag.sweep.stop_on=[critical]", f"diag.sweep.planned_steps={STEPS}", f"hydra.sweep.dir={sweep}"]
    proc = warm.run(cmd, cwd=app, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]

    doc = json.loads((sweep / "optuna_study.json").read_text())
    study = optuna.load_study(study_name=doc["study_name"], storage=doc["storage"])
    trials = {t.params["optimizer.lr"]: t for t in study.trials}
    assert sorted(trials) == LRS
    State = optuna.trial.TrialState
    pruned = {lr for lr, t in trials.items() if t.state == State.PRUNED}
    assert max(LRS) in pruned and min(LRS) not in pruned, {lr: t.state for lr, t in trials.items()}
    for lr, t in trials.items():
        run_dir = Path(t.user_attrs["trackdiag.run_dir"])
        alerts = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines() if line.strip()]
        critical = [a for a in alerts if a["severity"] == "critical"]
        if lr in pruned:  # stopped at its first critical alert, the alert as the reason
            a = t.user_attrs
            assert critical and a["trackdiag.stop.kind"] == critical[0]["kind"], (lr, a, critical)
            assert a["trackdiag.stop.reason"].startswith(f"trackdiag critical {critical[0]['kind']} at step")
            assert 0 <= a["trackdiag.stop.stop_step"] - critical[0]["step"] <= 10
            assert a["trackdiag.stop.steps_saved"] == STEPS - a["trackdiag.stop.steps_run"] > 0
            trial_json = json.loads((run_dir / "trial.json").read_text())
            assert trial_json["number"] == t.number and trial_json["stopped"]["kind"] == critical[0]["kind"]
        else:  # healthy: ran every step, its return value told
            assert t.state == State.COMPLETE and not critical, (lr, t.state, critical)
            assert math.isfinite(t.value) and "trackdiag.stopped" not in t.user_attrs
            assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    assert study.best_trial.params["optimizer.lr"] not in pruned and math.isfinite(study.best_value)

    comparison = json.loads((sweep / "comparison.json").read_text())
    saved = sum(trials[lr].user_attrs["trackdiag.stop.steps_saved"] for lr in pruned)
    assert comparison["stops"] == {"trials": len(LRS), "stopped": len(pruned), "steps_saved": saved,
                                   "seconds_saved": pytest.approx(comparison["stops"]["seconds_saved"])}
    stopped_rows = {r["trial"]["trial"] for r in comparison["runs"] if r["trial"]["stopped"]}
    assert stopped_rows == {trials[lr].number for lr in pruned}

    from mlflow import MlflowClient

    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    parents = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])
               if "mlflow.parentRunId" not in r.data.tags and r.data.tags.get("trackdiag.sweep_dir", str(sweep)) == str(sweep)]
    assert any(r.data.metrics.get("trackdiag/stopped") == len(pruned)
               and r.data.metrics.get("trackdiag/steps_saved") == saved for r in parents), [r.data.metrics for r in parents]
    print(f"\n{len(LRS)} trials x {STEPS} steps: {len(pruned)} pruned ({sorted(pruned)}), {saved} trial-steps saved, "
          f"{comparison['stops']['seconds_saved']:.1f} s; best lr {study.best_trial.params['optimizer.lr']}")

"""Issue 46 (c): a sweep's comparison says which Optuna trials trackdiag stopped, at which step and what
that saved; ``trackdiag compare optuna:<storage>#<study>`` shows the study's trials beside their runs'
health; the parent run gets the totals. Also (b)'s config keys and the sweeper's search space.

A real 3-trial study on SQLite: real sessions train a small MLP on digits with SGD; the trial with a huge
learning rate explodes and is stopped by :func:`trackdiag.integrations.optuna.watch_trial`.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from conftest import make_mlp

import trackdiag
from trackdiag.compare.comparison import compare
from trackdiag.compare.outputs import write_outputs
from trackdiag.core.errors import ConfigError

import _warm as warm

optuna = pytest.importorskip("optuna")
REPO = Path(__file__).resolve().parents[1]
STEPS = 30
LRS = [0.01, 0.1, 1e5]


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory, digits: tuple[torch.Tensor, torch.Tensor]) -> tuple[Path, str]:
    """(the dir of the runs' local records, the study's ``optuna:`` source)."""
    from trackdiag.integrations.optuna import watch_trial

    root = tmp_path_factory.mktemp("optuna_runs")
    storage = f"sqlite:///{root / 'optuna.db'}"
    x, y = digits
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial: Any) -> float:
        lr = trial.suggest_categorical("lr", LRS)
        torch.manual_seed(0)
        model = make_mlp()
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        with watch_trial(trial, planned_steps=STEPS):
            with trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], every=5, budget=None,
                                       output_dir=str(root / f"run{trial.number}"), hparams={"lr": lr}) as diag:
                for step in range(STEPS):
                    idx = torch.arange(step * 32, step * 32 + 32) % len(x)
                    loss = F.cross_entropy(model(x[idx]), y[idx])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if diag.step(loss):
                        break
        return float(loss.detach())

    s = optuna.create_study(study_name="lrs", storage=storage, pruner=optuna.pruners.NopPruner(),
                            sampler=optuna.samplers.GridSampler({"lr": LRS}))
    s.optimize(objective, n_trials=len(LRS))
    return root, f"optuna:{storage}#lrs"


def test_local_comparison_has_the_stop_columns(study: tuple[Path, str], tmp_path: Path) -> None:
    root, _ = study
    comp = compare(root)
    assert comp.has_trials
    by_lr = {r.hparams["lr"]: r for r in comp.runs}
    top = by_lr[max(LRS)]
    doc = json.loads((Path(top.source_id) / "trial.json").read_text())
    assert doc["stopped"] is not None, doc  # the explosion stopped the trial
    assert top.trial["stopped"] == doc["stopped"]["kind"] and top.trial["state"] == "PRUNED"
    assert top.trial["stop_step"] == doc["stopped"]["stop_step"] < STEPS - 1
    assert top.trial["steps_saved"] == STEPS - doc["stopped"]["steps_run"] > 0
    assert top.health == "critical"
    for lr in LRS[:-1]:
        assert by_lr[lr].trial["stopped"] is None and by_lr[lr].trial["trial"] is not None
    assert comp.stops == {"trials": 3, "stopped": 1, "steps_saved": top.trial["steps_saved"],
                          "seconds_saved": top.trial["seconds_saved"]}
    written = write_outputs(comp, tmp_path, plots=False)
    head = written["csv"].read_text().splitlines()[0].split(",")
    assert {"trial", "state", "stopped", "stop_step", "steps_saved", "seconds_saved"} <= set(head)
    assert json.loads(written["json"].read_text())["stops"]["stopped"] == 1
    html = written["html"].read_text()
    assert "<th class=''>stop_step</th>" in html and "1 stopped by trackdiag" in html


def test_optuna_source_joins_trials_to_runs(study: tuple[Path, str]) -> None:
    root, source = study
    comp = compare(source)
    assert len(comp.runs) == 3 and comp.has_trials
    by_lr = {r.hparams["lr"]: r for r in comp.runs}
    top = by_lr[max(LRS)]
    assert top.trial["state"] == "PRUNED" and top.trial["stopped"] and "critical" in top.trial["reason"]
    assert top.health == "critical" and top.diagnosed  # the run's record was found through trackdiag.run_dir
    assert Path(top.source_id).parent == root
    for lr in LRS[:-1]:
        r = by_lr[lr]
        assert r.trial["state"] == "COMPLETE" and math.isfinite(r.trial["value"]) and r.health == "ok"
        assert r.best_loss is not None  # the record's losses, beside the study's value


def test_cli_compare_optuna_source(study: tuple[Path, str]) -> None:
    _, source = study
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "COLUMNS": "250"}
    out = warm.run([sys.executable, "-m", "trackdiag", "compare", source, "--format", "csv"],
                   capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    head = lines[0].split(",")
    rows = [dict(zip(head, line.split(","))) for line in lines[1:]]
    assert sorted(r["state"] for r in rows) == ["COMPLETE", "COMPLETE", "PRUNED"]
    pruned = next(r for r in rows if r["state"] == "PRUNED")
    assert pruned["health"] == "critical" and pruned["stopped"] and int(pruned["steps_saved"]) > 0
    text = warm.run([sys.executable, "-m", "trackdiag", "compare", source], capture_output=True, text=True,
                    env=env, timeout=300)
    assert text.returncode == 0 and "3 trials: 1 stopped by trackdiag" in text.stdout, text.stdout[-2000:]
    bad = warm.run([sys.executable, "-m", "trackdiag", "compare", source + "x"], capture_output=True, text=True,
                   env=env, timeout=300)
    assert bad.returncode == 2 and "no study 'lrsx'" in bad.stderr + bad.stdout


def test_parent_run_gets_the_stop_totals(study: tuple[Path, str], tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from trackdiag.hydra.sweep_mlflow import publish

    root, _ = study
    comp = compare(root)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.create_run(client.create_experiment("sweep")).info.run_id
    publish(client, parent, {"a": "FINISHED"}, [], comp.stops)
    run = client.get_run(parent)
    assert run.data.metrics["trackdiag/stopped"] == 1 and run.data.metrics["trackdiag/trials"] == 3
    assert run.data.metrics["trackdiag/steps_saved"] == comp.stops["steps_saved"] > 0
    assert run.data.tags["trackdiag.trials_stopped"] == "1"


def test_sweep_config_is_validated() -> None:
    with pytest.raises(ConfigError) as e:
        trackdiag.Diagnostics(make_mlp(), level="basic", sinks=["local"],
                              sweep={"stop_on": "critical", "on_stop": "kill", "planned_steps": 0, "bogus": 1})
    text = str(e.value)
    for needle in ("diag.sweep.stop_on: expected list[str] or null", "diag.sweep.on_stop: 'kill' is not one of prune, fail",
                   "diag.sweep.planned_steps: 0 is not a step count", "diag.sweep.bogus: unknown option"):
        assert needle in text, text


def test_sweeper_search_space() -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from hydra_plugins.trackdiag_optuna.sweeper import search_space

    parsed = OverridesParser.create().parse_overrides(
        ["lr=tag(log, interval(1e-4, 1e2))", "depth=tag(int, interval(1, 4))", "act=choice(relu, tanh)", "hidden=range(16, 64, 16)",
         "wd=0.0,0.1", "steps=40"])
    space, fixed = search_space(parsed)
    d = optuna.distributions
    assert space["lr"] == d.FloatDistribution(1e-4, 1e2, log=True)
    assert space["depth"] == d.IntDistribution(1, 4)
    assert space["act"] == d.CategoricalDistribution(["relu", "tanh"])
    assert space["hidden"] == d.CategoricalDistribution([16, 32, 48])
    assert space["wd"] == d.CategoricalDistribution([0.0, 0.1])
    assert fixed == ["steps=40"]

"""``trackdiag compare mlflow:<experiment>`` as a user's experiment really looks: trackdiag runs of two
presets (their ``diag.*`` params differ in which keys exist), a sweep over the learning rate, and a
plain MLflow run that never used trackdiag. Only the user's hyperparameters that differ and the
trackdiag settings that differ between runs that have them become columns; nothing reads ``null``;
the plain run is ``no trackdiag``, not FAILED, and stays out of the risk lines."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from trackdiag.compare import compare, write_outputs  # noqa: E402
from trackdiag.compare.runs import RunSummary, swept_params  # noqa: E402
from trackdiag.compare.table import render_text, to_csv  # noqa: E402

BASIC = {"diag.level": "basic", "diag.every": "50", "diag.probes.loss.enabled": "True"}
ADVANCED = {"diag.level": "advanced", "diag.every": "50", "diag.probes.loss.enabled": "True",
            "diag.probes.activations.enabled": "True", "diag.probes.activations.every": "50"}


def _store(tmp_path: Path) -> str:
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    from _mlflow_util import ready_store

    uri = ready_store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    eid = client.create_experiment("mixed", artifact_location=(tmp_path / "artifacts").as_uri())
    spec = [(1e-3, BASIC, "ok", {}), (1e-1, BASIC, "critical", {"loss_divergence": 12}),
            (1e-3, ADVANCED, "ok", {}), (1e-1, ADVANCED, "critical", {"grad_explosion": 7})]
    for i, (lr, diag, health, alerts) in enumerate(spec):
        tags = {"trackdiag.level": diag["diag.level"], "trackdiag.health": health,
                **{f"trackdiag.alert.{k}": str(s) for k, s in alerts.items()}}
        run = client.create_run(eid, tags=tags, run_name=f"run{i}")
        params = [Param("optimizer.lr", str(lr)), Param("seed", "0")] + [Param(k, v) for k, v in diag.items()]
        metrics = [Metric("diag/loss", 2.0 - s / 50, 0, s) for s in range(20)]
        metrics += [Metric(f"diag/alerts/{k}", 1, 0, 20) for k in alerts]
        client.log_batch(run.info.run_id, metrics=metrics, params=params, tags=[RunTag("x", "y")])
        client.set_terminated(run.info.run_id, "FINISHED")
    plain = client.create_run(eid, run_name="notebook")  # someone's own run: no trackdiag at all
    client.log_batch(plain.info.run_id, params=[Param("optimizer.lr", "0.01"), Param("seed", "0")],
                     metrics=[Metric("val_acc", 0.9, 0, 0)])
    client.set_terminated(plain.info.run_id, "FINISHED")
    return uri


def test_mlflow_experiment_with_presets_and_a_plain_run(tmp_path: Path) -> None:
    uri = _store(tmp_path)
    c = compare("mlflow:mixed", tracking_uri=uri)
    by = {r.name: r for r in c.runs}
    assert c.swept == ["optimizer.lr", "diag.level"]  # not every activations key the basic runs lack
    plain = by["notebook"]
    assert plain.display_health == "no trackdiag" and plain.status == "FINISHED" and not plain.diagnosed
    assert "not a trackdiag run" in plain.note and c.runs[-1] is plain  # listed after the diagnosed runs
    assert "4 runs" not in c.headline and "1 no trackdiag" in c.headline
    lines = c.risk_lines
    assert "optimizer.lr=0.1: 2/2 runs anomalous (grad_explosion, loss_divergence)" in lines
    assert "optimizer.lr=0.001: 0/2 runs anomalous" in lines  # the plain run (lr=0.01) is not counted
    assert not any("null" in line or "0.01" in line for line in lines), lines
    text = render_text(c)
    assert "no trackdiag" in text and "FAILED" not in text and "null" not in text
    assert to_csv(c).splitlines()[0].startswith("run,status,health,optimizer.lr,diag.level,")
    written = write_outputs(c, tmp_path / "out")
    assert json.loads(written["json"].read_text())["swept"] == ["optimizer.lr", "diag.level"]
    html = written["html"].read_text()
    assert "<tr class='none'>" in html and "no trackdiag" in html


def test_settings_only_differing_where_present_and_unset_user_params() -> None:
    a = RunSummary("a", "a", hparams={"lr": 0.1, "diag.every": 10, "diag.probes.x.enabled": True})
    b = RunSummary("b", "b", hparams={"lr": 0.2, "diag.every": 10})
    c = RunSummary("c", "c", hparams={"lr": 0.2, "diag.every": 50, "extra": 1})
    assert swept_params([a, b]) == ["lr"]  # a key only one run has is no trackdiag column
    assert swept_params([a, b, c]) == ["extra", "lr", "diag.every"]  # users' keys first; a missing user key counts
    from trackdiag.compare.risk import param_risk

    [extra] = [p for p in param_risk([a, b, c], ["extra"])]
    assert [v.describe("extra") for v in extra.values] == ["extra=(unset): 0/2 runs anomalous",
                                                           "extra=1: 0/1 runs anomalous"]

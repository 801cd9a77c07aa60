"""``trackdiag compare``: local sweeps (synthetic and a real Hydra multirun), MLflow, W&B, the callback."""
from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trackdiag.core.alert import Alert
from trackdiag.alerts.book import AlertBook
from trackdiag.compare import CompareError, compare, load_runs, write_outputs
from trackdiag.compare.table import render_text, rows, to_csv
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.local import LocalSink

import _warm as warm

REPO = Path(__file__).resolve().parents[1]
KINDS = {"loss_divergence": "critical", "grad_explosion": "warning", "nonfinite_loss": "critical"}


def write_run(sweep: Path, num: int, hparams: dict[str, Any], alerts: list[tuple[str, int]], *, steps: int = 40,
              status: str = "FINISHED", close: bool = True) -> Path:
    """A job's local record written through the real LocalSink (alerts: (kind, step))."""
    sink, book = LocalSink(), AlertBook()
    out = sweep / str(num) / "diag"
    sink.open(RunInfo(name=f"train#{num}", output_dir=out, level="basic", config={}, hparams=hparams,
                      group=str(sweep), job_num=num))
    for step in range(0, steps, 10):
        fired = [Alert(kind=k, step=s, severity=KINDS[k], message="x") for k, s in alerts if step <= s < step + 10]
        for a in fired:
            if book.admit(a, cooldown=0):
                sink.alert(a)
        loss = 2.0 - step / 100 if not fired else math.nan
        sink.write(Record(step=step, scalars={"diag/eval/loss": 2.5 - step / 100},
                          series={"diag/loss": [(s, loss) for s in range(step, step + 10)]}, alerts=fired))
    if close:
        sink.close(status, {"steps": steps, "health": book.health(),
                            "alerts": {k: dict(v) for k, v in book.kinds.items()}})
    else:
        sink.flush()
    (sweep / str(num) / ".hydra").mkdir(exist_ok=True)
    (sweep / str(num) / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={hparams['optimizer']['lr']}\n")
    return out


@pytest.fixture()
def synthetic(tmp_path: Path) -> Path:
    """lr x depth grid: lr=0.1 diverges; job 4 is live (no summary); job 5 died before diagnostics;
    job 6 ran without trackdiag."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    grid = [(1e-3, 2, []), (1e-3, 8, []), (0.1, 2, [("loss_divergence", 21), ("grad_explosion", 25)]),
            (0.1, 8, [("loss_divergence", 12)])]
    for num, (lr, depth, alerts) in enumerate(grid):
        write_run(sweep, num, {"seed": 0, "optimizer": {"lr": lr}, "model": {"depth": depth}}, alerts)
    write_run(sweep, 4, {"seed": 0, "optimizer": {"lr": 1e-2}, "model": {"depth": 2}}, [("grad_explosion", 7)],
              close=False)
    hydra = sweep / "5" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "overrides.yaml").write_text("- optimizer.lr=0.01\n- model.depth=8\n")
    (hydra / "config.yaml").write_text("seed: 0\noptimizer:\n  lr: 0.01\nmodel:\n  depth: 8\ndiag:\n  level: basic\n")
    plain = sweep / "6" / ".hydra"  # a job whose config never turned trackdiag on
    plain.mkdir(parents=True)
    (plain / "overrides.yaml").write_text("- optimizer.lr=0.001\n")
    (plain / "config.yaml").write_text("seed: 0\noptimizer:\n  lr: 0.001\nmodel:\n  depth: 2\n")
    return sweep


def test_local_sweep_table_risk_and_outputs(synthetic: Path, tmp_path: Path) -> None:
    c = compare(synthetic)
    by = {r.job_num: r for r in c.runs}
    assert c.swept == ["model.depth", "optimizer.lr"]
    assert [r.job_num for r in c.runs[:2]] == [3, 2]  # critical first, earliest anomaly first
    assert by[2].alert_counts == {"loss_divergence": 1, "grad_explosion": 1} and by[2].first_anomaly == 21
    assert by[2].first_steps == {"loss_divergence": 21, "grad_explosion": 25} and by[2].health == "critical"
    assert by[0].health == "ok" and by[0].first_anomaly is None and by[0].best_eval_loss == pytest.approx(2.2)
    assert by[0].final_loss == pytest.approx(2.0 - 30 / 100) and by[0].best_loss == pytest.approx(1.7)
    assert by[3].final_loss == pytest.approx(1.7) and any(math.isnan(v) for _, v in by[3].loss_curve)
    # live run: no summary.json, alerts read from alerts.jsonl
    assert by[4].status == "RUNNING" and by[4].health == "warning" and by[4].first_steps == {"grad_explosion": 7}
    assert "no summary.json" in by[4].note
    # a job that never started diagnostics: failed, with its overrides and config
    assert by[5].status == "FAILED" and by[5].display_health == "failed"
    assert by[5].overrides == ["optimizer.lr=0.01", "model.depth=8"] and by[5].hparams["optimizer.lr"] == 0.01
    assert by[0].overrides == ["optimizer.lr=0.001"]
    # a job without trackdiag in its config: shown as such, not failed, and left out of the risk lines
    assert by[6].display_health == "no trackdiag" and by[6].status == "UNKNOWN" and not by[6].failed
    assert "optimizer.lr=0.001: 0/2 runs anomalous" in c.risk_lines
    assert "optimizer.lr=0.1: 2/2 runs anomalous (loss_divergence, grad_explosion)" in c.risk_lines
    assert "optimizer.lr=0.001: 0/2 runs anomalous" in c.risk_lines
    assert "optimizer.lr=0.01: 1/2 runs anomalous (grad_explosion), 1 failed" in c.risk_lines
    assert c.risk_lines[0].startswith("optimizer.lr")  # the decisive parameter comes first
    table = rows(c.runs, c.swept, c.kinds)
    assert table[0]["loss_divergence.first_step"] == 12 and table[0]["health"] == "critical"
    assert "2 critical, 1 warning, 1 failed, 2 ok, 1 no trackdiag" in c.headline and "#5" in render_text(c)
    csv_lines = to_csv(c).splitlines()
    assert csv_lines[0].startswith("run,status,health,model.depth,optimizer.lr,") and len(csv_lines) == 8
    written = write_outputs(c, tmp_path / "report")
    html = written["html"].read_text()
    assert html.count("data:image/png;base64,") == 3 and "optimizer.lr=0.1: 2/2 runs anomalous" in html
    assert json.loads(written["json"].read_text())["swept"] == ["model.depth", "optimizer.lr"]
    assert {"anomalies_by_param", "first_anomaly_vs_param", "loss_curves"} <= set(written)


def test_hydra_job_markers_override_run_status(synthetic: Path) -> None:
    jobs = synthetic / ".trackdiag" / "jobs"
    jobs.mkdir(parents=True)
    (jobs / "0.json").write_text(json.dumps({"status": "FAILED", "error": "RuntimeError: after close"}))
    (jobs / "5.json").write_text(json.dumps({"status": "COMPLETED"}))
    by = {r.job_num: r for r in load_runs(synthetic)}
    assert by[0].status == "FAILED" and "after close" in by[0].note and by[0].display_health == "failed"
    assert by[5].status == "FINISHED" and by[5].health == "unknown"  # diagnostics were simply off
    assert by[5].display_health == "no trackdiag" and not by[5].failed
    one = load_runs(synthetic / "0")  # one job of a sweep still sees its sweep's markers
    assert len(one) == 1 and one[0].status == "FAILED"


def test_cli_errors_and_csv(synthetic: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trackdiag.cli import main

    assert main(["compare", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "sweep"), "--parent", "abc"]) == 2
    assert main(["compare", str(synthetic), "--format", "csv"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run,status,health") and out[1].startswith("#3,FINISHED,critical")


def test_wandb_without_server_fails_fast_and_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on: nothing leaves the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    with pytest.raises(CompareError, match="not reachable.*trackdiag compare <sweep dir>"):
        compare("wandb:me/proj/sweep-1")
    with pytest.raises(CompareError, match="expected wandb:<entity>/<project>"):
        compare("wandb:onlyentity")


def _mlflow_store(tmp_path: Path) -> tuple[str, str, dict[str, str]]:
    """A store with what the trackdiag MLflow sink logs: a sweep parent and 5 child runs."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    eid = client.create_experiment("cmp-exp", artifact_location=(tmp_path / "artifacts").as_uri())
    sweep = str(tmp_path / "sweep")
    parent = client.create_run(eid, tags={"trackdiag.role": "sweep", "trackdiag.sweep": sweep}, run_name="sweep")
    ids: dict[str, str] = {}
    spec = [(1e-3, {}, "FINISHED"), (1e-1, {"loss_divergence": (2, 21)}, "FINISHED"),
            (1e-1, {"nonfinite_loss": (1, 12), "grad_explosion": (3, 15)}, "FINISHED"), (1e-3, {}, "FAILED"),
            (1e-2, {"grad_explosion": (1, 30)}, "FINISHED")]
    for num, (lr, alerts, status) in enumerate(spec):
        health = "ok" if not alerts else ("warning" if set(alerts) == {"grad_explosion"} else "critical")
        tags = {"mlflow.parentRunId": parent.info.run_id, "trackdiag.sweep": sweep, "trackdiag.health": health,
                **{f"trackdiag.alert.{k}": str(first) for k, (_, first) in alerts.items()}}
        run = client.create_run(eid, tags=tags, run_name=f"train-optimizer.lr={lr}#{num}")
        metrics = [Metric("diag/loss", 2.0 - s / 100 if not alerts else 2.0 + s, 0, s) for s in range(40)]
        metrics += [Metric("diag/eval/loss", 2.1 - s / 100, 0, s) for s in (19, 39)]
        metrics += [Metric(f"diag/alerts/{k}", n, 0, 40) for k, (n, _) in alerts.items()]
        params = [Param("optimizer.lr", str(lr)), Param("model.depth", "2"), Param("diag.sinks", '["local", "mlflow"]')]
        client.log_batch(run.info.run_id, metrics=metrics, params=params, tags=[RunTag("x", "y")])
        client.set_terminated(run.info.run_id, status)
        ids[str(num)] = run.info.run_id
    client.set_terminated(parent.info.run_id, "FAILED")
    return uri, parent.info.run_id, ids


@pytest.mark.slow
def test_mlflow_reader_paginates_and_matches_the_contract(tmp_path: Path) -> None:
    """Store built by hand through MlflowClient with the documented params/tags/metrics."""
    from mlflow.tracking import MlflowClient
    from omegaconf import OmegaConf

    from trackdiag.compare.mlflow_source import load_mlflow
    from trackdiag.hydra.callback import log_to_mlflow_parent

    uri, parent, ids = _mlflow_store(tmp_path)
    runs = load_mlflow("cmp-exp", tracking_uri=uri, page_size=2)  # 3 pages; the parent is left out
    by = {r.job_num: r for r in runs}
    assert sorted(by) == [0, 1, 2, 3, 4] and by[0].source_id == ids["0"]
    assert by[2].alert_counts == {"nonfinite_loss": 1, "grad_explosion": 3} and by[2].first_anomaly == 12
    assert by[1].first_steps == {"loss_divergence": 21} and by[1].health == "critical"
    assert by[3].status == "FAILED" and by[3].display_health == "failed"
    assert by[0].final_loss == pytest.approx(1.61) and by[0].best_eval_loss == pytest.approx(1.71)
    assert by[0].hparams["optimizer.lr"] == 0.001 and by[0].hparams["diag.sinks"] == ["local", "mlflow"]
    c = compare("mlflow:cmp-exp", tracking_uri=uri, parent=parent)
    assert c.swept == ["optimizer.lr"] and [r.job_num for r in c.runs][:3] == [2, 1, 4]
    assert "optimizer.lr=0.1: 2/2 runs anomalous (grad_explosion, loss_divergence, nonfinite_loss)" in c.risk_lines
    eid = MlflowClient(tracking_uri=uri).get_experiment_by_name("cmp-exp").experiment_id
    assert len(compare(f"mlflow:{eid}", tracking_uri=uri).runs) == 5  # by id too
    with pytest.raises(CompareError, match="no MLflow experiment 'nope'.*cmp-exp"):
        compare("mlflow:nope", tracking_uri=uri)
    # the callback's helper logs the comparison to the sweep's parent run
    report = tmp_path / "comparison.html"
    report.write_text("<html></html>")
    cfg = OmegaConf.create({"diag": {"sinks": ["local", "mlflow"], "sink": {"mlflow": {"tracking_uri": uri}}}})
    assert log_to_mlflow_parent(cfg, tmp_path / "sweep", [report])
    files = [f.path for f in MlflowClient(tracking_uri=uri).list_artifacts(parent, "trackdiag")]
    assert files == ["trackdiag/comparison.html"]


def _hydra_sweep(base: Path, *extra: str) -> tuple[Path, subprocess.CompletedProcess]:
    """The example app as a 4-job multirun from a dir outside the repo: healthy, NaN input, LR blow-up, crash."""
    sweep = base / "sweep"
    preset_has_callback = "callback: compare" in (REPO / "trackdiag/conf/diag/basic.yaml").read_text()
    cmd = [sys.executable, str(REPO / "examples" / "train.py"), "-m", "+diag=basic",
           *([] if preset_has_callback else ["+diag/callback=compare"]),
           "steps=120", "eval_every=40", "fault=none,nan_input,lr_explode,crash", "fault_step=60",
           f"hydra.sweep.dir={sweep}", *(extra or ["diag.sinks=[local]"])]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MLFLOW_TRACKING_URI": ""}
    proc = warm.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=300)
    return sweep, proc


HAS_MLFLOW_SINK = (REPO / "trackdiag/sinks/mlflow/sink.py").exists() and (REPO / "trackdiag/conf/diag/sink/mlflow.yaml").exists()


@pytest.fixture(scope="module")
def hydra_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One multirun for both the local and the MLflow comparison (the MLflow sink when it exists)."""
    base = tmp_path_factory.mktemp("cmp_hydra")
    mlflow = ["diag/sink=mlflow", "diag.sinks=[local,mlflow]",
              f"diag.sink.mlflow.tracking_uri=sqlite:///{base / 'mlflow.db'}"] if HAS_MLFLOW_SINK else []
    return _hydra_sweep(base, *mlflow)


def _check_faulty_runs(runs: dict[int, dict[str, Any]]) -> None:
    """Exactly the faulty runs are anomalous, with the right kinds and first steps; the crash is failed."""
    assert sorted(runs) == [0, 1, 2, 3]
    assert {n for n, r in runs.items() if r["anomalous"]} == {1, 2}
    assert runs[0]["status"] == "FINISHED" and runs[0]["display_health"] == "ok" and runs[0]["alert_counts"] == {}
    assert runs[1]["display_health"] == "critical" and runs[1]["first_steps"]["nonfinite_loss"] == 60
    assert runs[1]["first_anomaly"] == 60
    kinds2 = set(runs[2]["alert_counts"])
    assert kinds2 & {"loss_spike", "loss_divergence", "grad_explosion"}, kinds2
    assert runs[2]["display_health"] in ("warning", "critical") and 60 <= runs[2]["first_anomaly"] <= 70
    # the crash finding describes the failure the status names: the run is failed, not anomalous
    assert runs[3]["status"] == "FAILED" and runs[3]["display_health"] == "failed"
    assert set(runs[3]["alert_counts"]) <= {"crash"}
    assert runs[0]["final_loss"] is not None and runs[0]["best_eval_loss"] is not None


@pytest.mark.slow
def test_hydra_multirun_compare_api_cli_and_callback(hydra_sweep: tuple[Path, subprocess.CompletedProcess],
                                                     tmp_path: Path) -> None:
    sweep, proc = hydra_sweep
    assert proc.returncode != 0 and "planted crash at step 60" in proc.stderr  # the crash fails the multirun
    c = compare(sweep)
    _check_faulty_runs({r.job_num: r.to_dict() for r in c.runs})
    assert c.swept == ["fault"] and c.runs[-1].job_num == 0  # healthy last
    assert any(line.startswith("fault=nan_input: 1/1 runs anomalous (") for line in c.risk_lines)
    assert "fault=crash: 0/1 runs anomalous, 1 failed" in c.risk_lines
    # the callback wrote the comparison although on_multirun_end never ran (a job failed)
    assert json.loads((sweep / ".trackdiag" / "jobs" / "3.json").read_text())["status"] == "FAILED"
    csv_lines = (sweep / "comparison.csv").read_text().splitlines()
    assert len(csv_lines) == 5 and any(x.startswith("#3,FAILED,failed") for x in csv_lines)
    assert (sweep / "comparison.html").read_text().count("data:image/png;base64,") == 3
    # the CLI, as a user runs it
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cli = warm.run([sys.executable, "-m", "trackdiag", "compare", str(sweep), "--format", "json",
                          "--out", str(tmp_path / "out"), "--no-plots"], env=env, capture_output=True, text=True,
                   timeout=120)
    assert cli.returncode == 0, cli.stderr
    data = json.loads(cli.stdout)
    _check_faulty_runs({r["job_num"]: r for r in data["runs"]})
    assert data["swept"] == ["fault"] and "wrote comparison.csv" in cli.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["comparison.csv", "comparison.html",
                                                                    "comparison.json"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MLFLOW_SINK, reason="the MLflow sink is not in this checkout")
def test_same_sweep_through_mlflow_compares_identically(hydra_sweep: tuple[Path, subprocess.CompletedProcess]) -> None:
    from mlflow.tracking import MlflowClient

    sweep, _ = hydra_sweep
    uri = f"sqlite:///{sweep.parent / 'mlflow.db'}"
    local, remote = compare(sweep), compare("mlflow:train", tracking_uri=uri)  # experiment: the Hydra job name
    assert remote.swept == local.swept == ["fault"]
    fields = ("label", "status", "display_health", "alert_counts", "first_steps", "first_anomaly", "final_loss",
              "best_loss", "best_eval_loss", "steps")
    as_rows = lambda c: [{f: json.dumps(r.to_dict()[f]) for f in fields} for r in c.runs]  # noqa: E731
    assert as_rows(remote) == as_rows(local)
    assert remote.risk_lines == local.risk_lines
    parent = MlflowClient(tracking_uri=uri).search_runs(
        [MlflowClient(tracking_uri=uri).get_experiment_by_name("train").experiment_id],
        filter_string="tags.`trackdiag.role` = 'sweep'")[0]
    assert len(compare("mlflow:train", tracking_uri=uri, parent=parent.info.run_id).runs) == 4
    files = {f.path for f in MlflowClient(tracking_uri=uri).list_artifacts(parent.info.run_id, "trackdiag")}
    assert files == {"trackdiag/comparison.html", "trackdiag/comparison.csv",
                     "trackdiag/comparison.json"}  # logged by the callback, once every job ended

"""MLflow sink against a real local SQLite store (one per module, under tmp): metrics equal the
local record point for point, params/tags/artifacts/alerts, user-owned runs, sweeps, run status,
outage spooling and ``trackdiag sync``."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

import mlflow  # noqa: E402
from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.cli import main as cli_main  # noqa: E402
from trackdiag.core.record import Histogram, Record  # noqa: E402
from trackdiag.core.runinfo import RunInfo  # noqa: E402
from trackdiag.sinks.mlflow.ops import MAX_BYTES, chunk_metrics, sanitize_key  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

from _mlflow_util import free_port, history, local_points, same_points, tiny_model, train  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may land in the repo or the cwd
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _session(tmp_path: Path, store: str, experiment: str, **mlflow_opts: Any) -> tuple[Any, Any, Any]:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["mlflow"], output_dir=str(tmp_path / "run"),
                                 hparams={"optimizer": {"lr": 0.05, "name": "sgd"}, "layers": [8, 16, 4]},
                                 sink={"mlflow": {"tracking_uri": store, "experiment": experiment, **mlflow_opts}})
    return diag, model, opt


def _mlflow_sink(diag: Any) -> MlflowSink:
    return next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))


def test_training_run_matches_local_record(tmp_path: Path, store: str) -> None:
    diag, model, opt = _session(tmp_path, store, "train")
    with diag:
        train(diag, model, opt, range(25), nan_step=7)
    run_id = _mlflow_sink(diag).run_id
    client = MlflowClient(store)
    run = client.get_run(run_id)
    local = local_points(tmp_path / "run")
    assert run.info.status == "FINISHED"
    assert local["diag/grad/global_norm"] and same_points(history(client, run_id, "diag/grad/global_norm"),
                                                         local["diag/grad/global_norm"])
    loss = history(client, run_id, "diag/loss")
    assert [s for s, _ in loss] == list(range(25)) and same_points(loss, local["diag/loss"])
    assert set(run.data.metrics) >= {sanitize_key(k) for k in local}
    assert sum(len(history(client, run_id, sanitize_key(k))) for k in local) == sum(map(len, local.values()))
    assert run.data.params == {"optimizer.lr": "0.05", "optimizer.name": "sgd", "layers": "[8, 16, 4]"}
    tags = run.data.tags
    assert tags["trackdiag.alert.nonfinite_loss"] == "7"
    assert tags["trackdiag.level"] == "advanced" and tags["trackdiag.version"] == trackdiag.__version__
    assert tags["trackdiag.health"] == "critical" and tags["trackdiag.run_dir"] == str(tmp_path / "run")
    counts = dict(history(client, run_id, "diag/alerts/nonfinite_loss"))  # running count, from step 0 to 24
    emitted = sorted(a.step for a in diag.alerts if a.kind == "nonfinite_loss")
    assert emitted[0] == 7 and {s: counts[s] for s in emitted} == {s: float(i + 1) for i, s in enumerate(emitted)}
    assert min(counts) == 0 and counts[0] == 0.0 and counts[6] == 0.0  # flat at 0 until the step before the alert
    assert max(counts) == 24 and counts[24] == float(len(emitted))  # the run's last step: the loss's x range
    summary = json.loads(Path(client.download_artifacts(run_id, "summary.json", str(tmp_path))).read_text())
    assert summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    alerts = json.loads(Path(client.download_artifacts(run_id, "alerts.json", str(tmp_path))).read_text())
    assert [a["kind"] for a in alerts] == [a.kind for a in diag.alerts]
    names = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "trackdiag")}
    assert {"config.yaml", "summary.json", "alerts.json", "trackdiag/diag_config.yaml"} <= names
    assert not (tmp_path / "run" / "mlflow_spool").exists()  # everything delivered: no spool left
    assert run.info.artifact_uri.startswith((Path(store[len("sqlite:///"):]).parent / "mlartifacts").as_uri())


def test_histograms_artifacts_and_key_mapping(tmp_path: Path, store: str) -> None:
    out = tmp_path / "run"
    (out / "plots").mkdir(parents=True)
    (out / "plots" / "grad_flow.html").write_text("<html>flow</html>")
    sink = MlflowSink(tracking_uri=store, experiment="hand-built", max_histogram_images=1, delivery="thread")
    sink.open(RunInfo(name="hand", output_dir=out, level="advanced", config={"every": 10}))
    hist = {"diag/grad/hist/encoder.0": Histogram([0.0, 1.0, 2.0], [3.0, 5.0]),
            "diag/grad/hist/(root)": Histogram([-1.0, 0.0, 1.0], [1.0, 1.0])}
    sink.write(Record(step=0, time=1.0, scalars={"diag/grad/norm/(root)": 1.0, "diag/grad/norm/blocks[0]:q": 2.0},
                      histograms=hist, tables={"diag/grad/norm": {"a.b": 1.0}}))
    sink.write(Record(step=10, time=2.0, histograms=hist, artifacts=[str(out / "plots" / "grad_flow.html")]))
    sink.alert(trackdiag.Alert("grad_explosion", 10, "warning", "big", where="(root)"))
    sink.alert(trackdiag.Alert("grad_explosion", 12, "warning", "big"))
    sink.flush()
    sink.close("FINISHED", {"health": "warning", "steps": 13})
    client = MlflowClient(store)
    rid = sink.run_id
    assert history(client, rid, "diag/grad/norm/_root_") == [(0, 1.0)]
    assert history(client, rid, "diag/grad/norm/blocks_0__q") == [(0, 2.0)]
    # step-shaped from the run's first step: 0 until the step before each alert, the count at its step
    assert history(client, rid, "diag/alerts/grad_explosion") == [(0, 0.0), (9, 0.0), (10, 1.0), (11, 1.0), (12, 2.0)]
    tags = client.get_run(rid).data.tags
    assert tags["trackdiag.alert.grad_explosion"] == "10" and tags["trackdiag.health"] == "warning"
    hists = sorted(a.path for a in client.list_artifacts(rid, "histograms"))
    assert hists == ["histograms/step_000000000.json", "histograms/step_000000010.json"]
    data = json.loads(Path(client.download_artifacts(rid, hists[1], str(tmp_path))).read_text())
    assert data["step"] == 10 and data["histograms"]["diag/grad/hist/encoder.0"] == {"edges": [0, 1, 2], "counts": [3, 5]}
    images = [a.path for a in client.list_artifacts(rid, "images")]
    assert len(images) >= 2 and all("encoder.0" in p for p in images)  # one key (cap=1), two steps
    assert [a.path for a in client.list_artifacts(rid, "plots")] == ["plots/grad_flow.html"]
    assert [a.path for a in client.list_artifacts(rid, "tables")] == ["tables/tables.jsonl"]
    key_map = json.loads(Path(client.download_artifacts(rid, "trackdiag/key_map.json", str(tmp_path))).read_text())
    assert key_map["diag/grad/norm/(root)"] == "diag/grad/norm/_root_"


def test_user_run_is_used_and_left_running(tmp_path: Path, store: str) -> None:
    mlflow.set_tracking_uri(store)
    try:
        mlflow.set_experiment("user-run")
        with mlflow.start_run() as user_run:
            model, opt = tiny_model()
            diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["mlflow"], output_dir=str(tmp_path / "r"),
                                         every=2)
            with diag:
                train(diag, model, opt, range(6))
            assert mlflow.active_run() is not None and mlflow.active_run().info.run_id == user_run.info.run_id
            client = MlflowClient(store)
            assert _mlflow_sink(diag).run_id == user_run.info.run_id
            assert client.get_run(user_run.info.run_id).info.status == "RUNNING"
            assert [s for s, _ in history(client, user_run.info.run_id, "diag/loss")] == list(range(6))
            assert len(client.search_runs([user_run.info.experiment_id])) == 1  # no second run beside it
        assert client.get_run(user_run.info.run_id).info.status == "FINISHED"
    finally:
        mlflow.set_tracking_uri(None)


@pytest.mark.parametrize(("exc", "status"), [(RuntimeError, "FAILED"), (KeyboardInterrupt, "KILLED")])
def test_run_status_on_exception(tmp_path: Path, store: str, exc: type[BaseException], status: str) -> None:
    diag, model, opt = _session(tmp_path, store, "status", delivery="thread")
    with pytest.raises(exc):
        with diag:
            train(diag, model, opt, range(3))
            raise exc("boom")
    assert MlflowClient(store).get_run(_mlflow_sink(diag).run_id).info.status == status


def test_sweep_jobs_share_one_parent(tmp_path: Path, store: str) -> None:
    group = str(tmp_path / "multirun" / "2024-01-01" / "12-00-00")
    ids = []
    for job, status in ((0, "FINISHED"), (1, "FAILED"), (2, "FINISHED")):
        sink = MlflowSink(tracking_uri=store, experiment="sweep", delivery="thread")
        sink.open(RunInfo(name=f"job#{job}", output_dir=tmp_path / str(job), level="basic", config={},
                          hparams={"lr": job}, group=group, job_num=job))
        sink.write(Record(step=0, scalars={"diag/loss": float(job)}))
        sink.close(status, {"health": "ok"})
        ids.append(sink.run_id)
    client = MlflowClient(store)
    parents = {client.get_run(i).data.tags["mlflow.parentRunId"] for i in ids}
    assert len(parents) == 1
    parent = client.get_run(parents.pop())
    assert parent.data.tags["trackdiag.sweep"] == group and parent.info.status == "FAILED"  # a job failed
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.data.params["lr"] for r in children) == ["0", "1", "2"]


def test_a_sweep_job_run_is_created_with_its_job_number(tmp_path: Path, store: str) -> None:
    """The run is made with trackdiag's tags (job number, sweep, level) in its creation call: a job killed
    right after it (a sweep's ``test_killed_job_is_killed_others_unaffected`` flaked this way under load) no
    longer leaves a child run without ``trackdiag.job_num`` until its spool is delivered. Only the sink's
    ``open`` op is run here, as the worker runs the first group."""
    from trackdiag.sinks.mlflow.run import Runner

    sink = MlflowSink(tracking_uri=store, experiment="sweep-open", delivery="thread", tags={"team": 7})
    group = str(tmp_path / "multirun" / "x")
    sink.open(RunInfo(name="job#3", output_dir=tmp_path / "3", level="basic", config={}, group=group, job_num=3))
    spec = dict(sink._state["spec"])
    sink.close("KILLED", {"health": "killed"})
    runner = Runner({"tracking_uri": store, "run_id": None, "spec": {**spec, "run_name": "opened only"}})
    runner.run_many([{"op": "open", "spec": {**spec, "run_name": "opened only"}}])
    tags = MlflowClient(store).get_run(runner.state["run_id"]).data.tags
    assert tags["trackdiag.job_num"] == "3" and tags["trackdiag.sweep"] == group and tags["team"] == "7"
    assert tags["trackdiag.level"] == "basic" and "mlflow.parentRunId" in tags


def test_outage_spools_and_sync_delivers(tmp_path: Path, store: str, caplog: pytest.LogCaptureFixture) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    diag, model, opt = _session(tmp_path, dead, "outage", close_timeout=1.0, retry_backoff=0.2)
    with caplog.at_level(logging.WARNING, logger="trackdiag"):
        with diag:
            train(diag, model, opt, range(15))
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # one warning, not one per step
    assert any("trackdiag sync" in r.getMessage() for r in caplog.records)
    assert list((tmp_path / "run" / "mlflow_spool").glob("seg-*.jsonl"))
    local = local_points(tmp_path / "run")
    again, model, opt = _session(tmp_path, dead, "outage", close_timeout=0.5, run_name="second")
    with again:  # a resumed run in the same dir: the old spool is set aside, not mixed in
        train(again, model, opt, range(3))
    assert (tmp_path / "run" / "mlflow_spool-1" / "meta.json").exists()
    assert cli_main(["sync", str(tmp_path / "run"), "--tracking-uri", store]) == 0
    client = MlflowClient(store)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("outage").experiment_id])}
    run = runs[diag.run.name]
    assert set(runs) == {diag.run.name, "second"}
    assert sum(len(history(client, run.info.run_id, sanitize_key(k))) for k in local) == sum(map(len, local.values()))
    assert run.info.status == "FINISHED" and run.data.tags["trackdiag.health"] == "ok"
    assert not list((tmp_path / "run").glob("mlflow_spool*"))


def test_keys_and_batches() -> None:
    assert sanitize_key("diag/grad/norm/(root)") == "diag/grad/norm/_root_"
    assert sanitize_key("diag//x/./y/") == "diag/x/_/y"
    assert sanitize_key("a:b\u00e9c") == "a_b_c"
    long = sanitize_key("diag/" + "x" * 400)
    assert len(long) == 250 and long != sanitize_key("diag/" + "x" * 401)
    def key_len(item: list[Any]) -> int:
        return len(item[0])
    chunks = list(chunk_metrics([[f"k{i}", 1.0, 0, i] for i in range(2500)], key_len))
    assert [len(c) for c in chunks] == [1000, 1000, 500]
    big = list(chunk_metrics([["k" * 1000, 1.0, 0, i] for i in range(1000)], key_len))
    assert len(big) > 1 and sum(map(len, big)) == 1000 and all(len(json.dumps(c)) < MAX_BYTES for c in big)


def test_missing_mlflow_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "mlflow" else real(n, *a))
    with pytest.raises(trackdiag.TrackdiagError, match=r"pip install mlflow"):
        MlflowSink()


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(trackdiag.ConfigError) as err:
        model, opt = tiny_model()
        trackdiag.Diagnostics(model, opt, sinks=["mlflow"], sink={"mlflow": {"retry_backoff": -1, "bogus": 1}})
    assert "diag.sink.mlflow.bogus" in str(err.value)
    with pytest.raises(trackdiag.ConfigError, match="retry_backoff"):
        MlflowSink(retry_backoff=-1.0)


def test_params_keep_the_users_hyperparameters_not_the_whole_preset(tmp_path: Path, store: str) -> None:
    """A Hydra user's ``hparams=cfg`` holds the whole ``diag`` node: MLflow's params get the user's keys,
    ``diag.level`` and what the user changed (here ``every``), not the 130-odd preset values; the whole
    preset is in the ``trackdiag/diag_config.yaml`` artifact."""
    from trackdiag.config.load import resolve

    diag_node = resolve({"level": "advanced", "every": 7})
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="advanced", every=7, sinks=["mlflow"], output_dir=str(tmp_path / "run"),
                                 hparams={"lr": 0.1, "diag": diag_node},
                                 sink={"mlflow": {"tracking_uri": store, "experiment": "params"}})
    with diag:
        train(diag, model, opt, range(3))
    client = MlflowClient(store)
    run_id = _mlflow_sink(diag).run_id
    assert client.get_run(run_id).data.params == {"lr": "0.1", "diag.level": "advanced", "diag.every": "7"}
    config = Path(client.download_artifacts(run_id, "trackdiag/diag_config.yaml", str(tmp_path)))
    assert "every: 7" in config.read_text() and "activations" in config.read_text()

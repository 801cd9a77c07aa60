"""The whole run in a real ``mlflow server`` on 127.0.0.1 reached through a loopback proxy that adds a
delay to every request: the example app 150 ms away, close waiting while delivery moves, the cap,
and leftover spools delivered by the next session. One server for the module (own process group,
killed whole); each proxy is its own process group too."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.cli import main as cli_main  # noqa: E402
from trackdiag.sinks.mlflow.ops import sanitize_key  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

import _warm as warm  # noqa: E402
from _delay_proxy import DelayProxy  # noqa: E402
from _mlflow_util import MlflowServer, free_port, history, local_points, tiny_model, train  # noqa: E402

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(mlflow_server: MlflowServer) -> MlflowServer:
    """The suite's shared server (conftest ``mlflow_server``); the delays and outages are the proxy's."""
    return mlflow_server


def _proxy(server: MlflowServer, tmp_path: Path, delay: float, port: int | None = None) -> DelayProxy:
    proxy = DelayProxy(server.uri, port or free_port(), delay, log=tmp_path / f"proxy-{delay}.log")
    proxy.start()
    return proxy


def _rest(server: MlflowServer, endpoint: str, **params: str) -> dict[str, Any]:
    """GET an MLflow REST endpoint straight from the server (not through the proxy)."""
    url = f"{server.uri}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _all_points_in_mlflow(client: MlflowClient, run_id: str, run_dir: Path) -> None:
    """Every (key, step) point of the local record is in the MLflow run."""
    for key, points in local_points(run_dir).items():
        stored = {s for s, _ in history(client, run_id, sanitize_key(key))}
        missing = {s for s, _ in points} - stored
        assert not missing, f"{key}: steps {sorted(missing)[:10]} not in MLflow"


def test_example_app_against_a_server_150ms_away(server: MlflowServer, tmp_path: Path) -> None:
    """The example as a user runs it (+diag=advanced, 300 steps): the run is FINISHED in MLflow with
    every point, in a handful of calls; the Source is the user's script; the experiment opens in the
    model-training view (both read back through the server's REST API)."""
    proxy = _proxy(server, tmp_path, 0.15)
    app = tmp_path / "app"
    shutil.copytree(REPO / "examples", app)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(MLFLOW_TRACKING_URI=proxy.uri)
    try:
        t0 = time.monotonic()
        proc = warm.run([sys.executable, "train.py", "+diag=advanced", f"hydra.run.dir={tmp_path / 'out'}"],
                        cwd=app, env=env, capture_output=True, text=True, timeout=400)
        wall = time.monotonic() - t0
        timed = proxy.timed_requests()
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "out" / "diag"
    client = MlflowClient(server.uri)
    [run] = client.search_runs([client.get_experiment_by_name("train").experiment_id],
                               f"tags.`trackdiag.run_dir` = '{run_dir}'")
    assert run.info.status == "FINISHED" and run.data.tags["trackdiag.status"] == "FINISHED"
    _all_points_in_mlflow(client, run.info.run_id, run_dir)
    assert not (run_dir / "mlflow_spool").exists()
    requests = [r for _, r in timed]
    closing = json.loads((run_dir / "run.json").read_text())["end_time"]  # the sinks began to close
    batches = [r for r in requests if "log-batch" in r]
    at_close = [r for t, r in timed if t >= closing and "log-batch" in r]
    assert len(at_close) <= 3, f"{len(at_close)} log_batch requests at close"
    assert len(batches) <= 15, f"{len(batches)} log_batch requests (one per record before merging: ~40)"
    # the server's artifact API takes one file per request (every per-step histogram image is a .png and a
    # .webp): each file is uploaded once; everything else is a handful of calls
    uploads = [r for r in requests if r.startswith("PUT ")]
    assert len(uploads) == len(set(uploads)), "a file uploaded twice"
    assert len(requests) - len(uploads) < 40, f"{len(requests) - len(uploads)} requests besides {len(uploads)} uploads"
    got = _rest(server, "runs/get", run_id=run.info.run_id)["run"]["data"]["tags"]
    tags = {t["key"]: t["value"] for t in got}
    assert tags["mlflow.source.name"] == str(app / "train.py") and tags["mlflow.source.type"] == "LOCAL"
    exp = _rest(server, "experiments/get-by-name", experiment_name="train")["experiment"]
    assert {t["key"]: t["value"] for t in exp["tags"]}["mlflow.experimentKind"] == "custom_model_development"
    print(f"\nexample app, server 150 ms away: {len(requests)} requests ({len(batches)} log_batch, {len(uploads)} uploads), "
          f"job {wall:.1f}s")


def _session(tmp_path: Path, uri: str, name: str, **mlflow: Any) -> tuple[Any, Any, Any]:
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=2, sinks=["mlflow"], run_name=name,
                                 output_dir=str(tmp_path / "runs" / name), hparams={"lr": 0.05},
                                 sink={"mlflow": {"tracking_uri": uri, "experiment": "delivery", **mlflow}})
    return diag, model, opt


def _files(run_dir: Path, n: int) -> list[str]:
    (run_dir / "extra").mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = run_dir / "extra" / f"f{i:02d}.json"
        p.write_text(json.dumps({"i": i}))
        paths.append(str(p))
    return paths


def test_close_waits_while_delivery_moves(server: MlflowServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    """Each request 0.6 s away and a backlog that needs many of them at close: delivery goes on
    past close_stall_timeout (it moves), one console line says what is left, everything arrives."""
    monkeypatch.chdir(tmp_path)
    proxy = _proxy(server, tmp_path, 0.6)
    try:
        diag, model, opt = _session(tmp_path, proxy.uri, "moving", close_stall_timeout=1.0, close_timeout=300.0,
                                    deliver_leftovers=False)
        sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
        with diag:
            train(diag, model, opt, range(10))
            from trackdiag.core.record import Record
            diag._hub.write(Record(step=9, artifacts=_files(diag.run.output_dir, 24)))
    finally:
        proxy.stop()
    client = MlflowClient(server.uri)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    assert len(client.list_artifacts(sink.run_id, "extra")) == 24
    _all_points_in_mlflow(client, sink.run_id, diag.run.output_dir)
    err = capfd.readouterr().err
    assert "trackdiag: delivering" in err and "to MLflow at " + proxy.uri in err, err[-2000:]
    assert not (diag.run.output_dir / "mlflow_spool").exists()


def test_cap_sets_the_status_and_sync_delivers_the_rest(server: MlflowServer, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """close_timeout reached while a slow server still answers: the run's status is set anyway, the
    rest (the end op with it) stays spooled, and ``trackdiag sync`` delivers it to the same run."""
    monkeypatch.chdir(tmp_path)
    port = free_port()
    proxy = _proxy(server, tmp_path, 1.0, port=port)
    try:
        diag, model, opt = _session(tmp_path, proxy.uri, "capped", close_timeout=1.0)
        sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
        with diag:
            train(diag, model, opt, range(6))
            diag.flush()
            t0 = time.monotonic()
            while sink.run_id is None and time.monotonic() - t0 < 60:
                time.sleep(0.2)
            from trackdiag.core.record import Record
            diag._hub.write(Record(step=5, artifacts=_files(diag.run.output_dir, 40)))
    finally:
        proxy.stop()
    client = MlflowClient(server.uri)
    assert client.get_run(sink.run_id).info.status == "FINISHED"  # set out of order, at the cap
    spool = diag.run.output_dir / "mlflow_spool"
    ops = [json.loads(line)["op"] for seg in sorted(spool.glob("seg-*.jsonl")) for line in seg.read_text().splitlines()]
    assert ops and ops[-1] == "end"  # the end op stays spooled with the rest
    proxy = _proxy(server, tmp_path, 0.0, port=port)  # the recorded store, answering quickly now
    try:
        assert cli_main(["sync", str(diag.run.output_dir)]) == 0
    finally:
        proxy.stop()
    assert len(client.list_artifacts(sink.run_id, "extra")) == 40
    _all_points_in_mlflow(client, sink.run_id, diag.run.output_dir)
    assert client.get_run(sink.run_id).info.status == "FINISHED" and not spool.exists()


def test_leftover_spools_are_delivered_by_the_next_session(server: MlflowServer, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capfd: pytest.CaptureFixture[str]) -> None:
    """A run whose store did not answer leaves a spool; the next session on the same store (same
    output root) delivers it in the background, once, and says so."""
    monkeypatch.chdir(tmp_path)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"  # nothing listens yet
    first, model, opt = _session(tmp_path, uri, "first", close_stall_timeout=1.0, retry_backoff=0.2)
    with first:
        train(first, model, opt, range(12))
    spool = first.run.output_dir / "mlflow_spool"
    assert list(spool.glob("seg-*.jsonl"))
    proxy = _proxy(server, tmp_path, 0.0, port=port)  # the store answers again, at the same address
    try:
        second, model, opt = _session(tmp_path, uri, "second")
        with second:
            train(second, model, opt, range(4))
            t0 = time.monotonic()
            while spool.exists() and time.monotonic() - t0 < 90:
                time.sleep(0.5)
    finally:
        proxy.stop()
    err = capfd.readouterr().err
    assert "delivering 1 MLflow spool(s) that earlier runs left under" in err, err[-3000:]
    assert not spool.exists()
    client = MlflowClient(server.uri)
    runs = {r.info.run_name: r for r in client.search_runs([client.get_experiment_by_name("delivery").experiment_id])}
    run = runs["first"]
    assert run.info.status == "FINISHED" and run.data.tags["trackdiag.status"] == "FINISHED"
    _all_points_in_mlflow(client, run.info.run_id, first.run.output_dir)
    assert runs["second"].info.status == "FINISHED"


@pytest.mark.parametrize("retries", ["2", "0"], ids=["mlflow_retries", "trackdiag_retries"])
def test_a_create_run_whose_answer_was_lost_leaves_one_run(server: MlflowServer, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch, retries: str) -> None:
    """The server creates the run but its answer is lost (a 503 instead): MLflow's HTTP client retries
    the POST itself (``retries=2``), or with its retries off the sink's deliverer tries the run's set-up
    again (``0``). Either way the store ends with one live run, holding every point, and no twin."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", retries)
    proxy = DelayProxy(server.uri, free_port(), 0.0, log=tmp_path / "proxy.log", lose_first="runs/create")
    proxy.start()
    try:
        diag, model, opt = _session(tmp_path, proxy.uri, f"lost-{retries}", retry_backoff=0.2)
        with diag:
            train(diag, model, opt, range(10))
        creates = [r for r in proxy.requests() if "runs/create" in r]
    finally:
        proxy.stop()
    # MLflow's client sends the POST again itself; the deliverer first looks the session's run up, finds it, uses it
    assert len(creates) == (2 if retries == "2" else 1), creates
    client = MlflowClient(server.uri)
    eid = client.get_experiment_by_name("delivery").experiment_id
    live = client.search_runs([eid], f"attributes.run_name = 'lost-{retries}'")
    assert len(live) == 1, [r.info.run_id for r in live]
    [run] = live
    assert run.info.status == "FINISHED"
    _all_points_in_mlflow(client, run.info.run_id, diag.run.output_dir)
    made = client.search_runs([eid], f"attributes.run_name = 'lost-{retries}'", run_view_type=3)  # ViewType.ALL
    if retries == "2":  # MLflow's retry made the twin: deleted
        assert len(made) == 2 and sum(r.info.lifecycle_stage == "deleted" for r in made) == 1
    else:  # the deliverer found the first one and used it: no twin was made
        assert len(made) == 1, [r.info.run_id for r in made]

"""End to end against a real ``mlflow server`` on 127.0.0.1: kill it mid-run, keep training, restart
it on the same store and port; every metric point of the local record ends up in MLflow."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.sinks.mlflow.ops import sanitize_key  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

from _mlflow_util import MlflowServer, history, local_points, tiny_model, train  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MlflowServer]:
    srv = MlflowServer(tmp_path)
    try:
        yield srv
    finally:
        srv.stop()  # the whole process group, whatever happened


def _wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what} not reached after {timeout}s")
        time.sleep(0.2)


def test_server_outage_loses_nothing(tmp_path: Path, server: MlflowServer, caplog: pytest.LogCaptureFixture,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    server.start()
    boot = server.wait()
    run_dir = tmp_path / "run"
    model, opt = tiny_model()
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=2, sinks=["mlflow"], output_dir=str(run_dir),
                                 hparams={"lr": 0.05},
                                 sink={"mlflow": {"tracking_uri": server.uri, "experiment": "outage",
                                                  "retry_backoff": 0.5, "retry_max_backoff": 2.0,
                                                  "close_timeout": 60.0}})
    sink = next(s for s in diag._hub.sinks if isinstance(s, MlflowSink))
    client = MlflowClient(server.uri)

    def stored() -> int:
        local = local_points(run_dir)
        return sum(len(history(client, sink.run_id, sanitize_key(k))) for k in local) if sink.run_id else -1

    with caplog.at_level(logging.INFO, logger="trackdiag"):
        with diag:
            train(diag, model, opt, range(0, 10))
            diag.flush()
            _wait_for(lambda: stored() > 0, 30, "first delivery")
            train(diag, model, opt, range(10, 20))
            diag.flush()
            server.stop()  # the server goes away mid-run, possibly mid-request
            train(diag, model, opt, range(20, 40))
            diag.flush()
            _wait_for(lambda: bool(list((run_dir / "mlflow_spool").glob("seg-*.jsonl"))), 30, "spooling")
            t0 = time.monotonic()
            server.start()  # same store, same port; training goes on while it boots
            train(diag, model, opt, range(40, 60))
            restart = time.monotonic() - t0 + server.wait()
            train(diag, model, opt, range(60, 70))
    local = local_points(run_dir)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.05"}
    assert [s for s, _ in history(client, sink.run_id, "diag/loss")] == list(range(70))
    for key, points in local.items():
        assert len(history(client, sink.run_id, sanitize_key(key))) == len(points), key
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 1 and any("is back after" in m for m in messages)
    assert not (run_dir / "mlflow_spool").exists()
    print(f"\nmlflow server: first boot {boot:.1f}s, restart until healthy {restart:.1f}s")

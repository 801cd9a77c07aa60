"""Coalescing: queued ops become the fewest MLflow calls the limits allow, against a real SQLite
store (the client's own methods counted, not replaced), and the packing rules on their own."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient  # noqa: E402

from trackdiag.core.record import Record  # noqa: E402
from trackdiag.core.runinfo import RunInfo  # noqa: E402
from trackdiag.sinks.mlflow.ops import MAX_BYTES  # noqa: E402
from trackdiag.sinks.base import SinkHub  # noqa: E402
from trackdiag.sinks.mlflow.sink import MlflowSink  # noqa: E402

from _mlflow_util import history, ready_store  # noqa: E402


class _Key:
    def __init__(self, key: str, step: int | None = 0, value: str = "") -> None:
        self.key, self.value = key, value
        if step is not None:
            self.step = step


def test_pack_respects_every_log_batch_limit() -> None:
    from trackdiag.sinks.mlflow.batch import pack

    size = lambda e: len(e.key) + (80 if hasattr(e, "step") else len(e.value) + 40)  # noqa: E731
    metrics = [_Key(f"m{i}") for i in range(2500)]
    params = [_Key(f"p{i}", None, "v") for i in range(150)]
    tags = [_Key(f"t{i}", None, "v") for i in range(250)]
    batches = list(pack(metrics, params, tags, size))
    for m, p, t in batches:
        assert len(m) <= 1000 and len(p) <= 100 and len(t) <= 100 and len(m) + len(p) + len(t) <= 1000
        assert sum(map(size, m + p + t)) <= MAX_BYTES
    assert [sum(len(b[i]) for b in batches) for i in range(3)] == [2500, 150, 250]
    assert len(batches) == math.ceil((2500 + 150 + 250) / 1000)  # as few calls as the entity limit allows
    big = list(pack([_Key("k" * 240) for _ in range(5000)], [], [], size))
    assert all(sum(map(size, m)) <= MAX_BYTES for m, _, _ in big) and sum(len(m) for m, _, _ in big) == 5000


def test_groups() -> None:
    from trackdiag.sinks.mlflow.batch import GROUP_POINTS, group_end

    pts = {"op": "points", "records": [[0, 0, {f"k{i}": 1.0 for i in range(400)}, {}]]}
    ops = [{"op": "open", "spec": {}}, {"op": "tags", "items": [["a", "b"]]}, pts, {"op": "artifact"}, pts,
           {"op": "end", "status": "FINISHED"}, {"op": "tags", "items": []}]
    assert group_end(ops, 0) == 1  # open alone
    assert group_end(ops, 1) == 6  # everything through the end op
    assert group_end(ops, 6) == 7
    many = [pts] * 100
    assert group_end(many, 0) == GROUP_POINTS // 400


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls: dict[str, int] = {}
    for name in ("log_batch", "log_artifact", "log_artifacts", "log_image", "log_metric", "set_tag"):
        real = getattr(MlflowClient, name)

        def counted(self: Any, *a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(self, *a, **k)

        monkeypatch.setattr(MlflowClient, name, counted)
    return calls


def test_a_run_is_delivered_in_a_handful_of_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """120 logged records (one op each, as the sink queues them), histograms and files: a few
    log_batch calls and one upload, not one call per record and per file. A file gone before
    delivery costs only its own op (MLflow's refusal of the merged group is retried op by op)."""
    monkeypatch.chdir(tmp_path)
    store = ready_store(tmp_path)
    calls = _count_calls(monkeypatch)
    out = tmp_path / "run"
    (out / "plots").mkdir(parents=True)
    for i in range(6):
        (out / "plots" / f"p{i}.json").write_text(json.dumps({"i": i}))
    sink = MlflowSink(tracking_uri=store, experiment="merged", delivery="thread")
    hub = SinkHub([sink])
    hub.open(RunInfo(name="merged", output_dir=out, level="advanced", config={}, hparams={"lr": 0.1, "depth": 2}))
    from trackdiag.core.record import Histogram

    for step in range(120):
        scalars = {f"diag/grad/norm/layer{i}": float(step + i) for i in range(8)}
        hist = {"diag/grad/hist/all": Histogram([0.0, 1.0, 2.0], [1.0, 2.0])} if step % 60 == 0 else {}
        arts = [str(out / "plots" / f"p{step // 20}.json")] if step % 20 == 0 else []
        arts += [str(out / "gone.json")] if step == 50 else []
        hub.write(Record(step=step, time=1.0 + step, scalars=scalars, histograms=hist, artifacts=arts))
        hub.drain()  # the queue runs dry after every record: each record is its own op
    hub.close("FINISHED", {"health": "ok", "status": "FINISHED"})
    client = MlflowClient(store)
    rid = sink.run_id
    assert client.get_run(rid).info.status == "FINISHED"
    assert [s for s, _ in history(client, rid, "diag/grad/norm/layer3")] == list(range(120))
    assert client.get_run(rid).data.params == {"lr": "0.1", "depth": "2"}
    assert {a.path for a in client.list_artifacts(rid, "plots")} == {f"plots/p{i}.json" for i in range(6)}
    assert len(client.list_artifacts(rid, "images")) == 4  # 2 histogram steps: image + thumbnail each
    assert calls.get("log_batch", 0) <= 6, calls  # ~1,000 points and ~10 tags: not one call per record
    assert calls.get("log_artifact", 0) + calls.get("log_artifacts", 0) + calls.get("log_image", 0) <= 8, calls
    rejected = [json.loads(x) for x in (out / "mlflow_spool" / "rejected.jsonl").read_text().splitlines()]
    assert [r["op"]["op"] for r in rejected] == ["artifact"] and "gone.json" in rejected[0]["error"]

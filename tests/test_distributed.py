"""torch.distributed: 2 gloo processes on CPU (DDP and FSDP2), rank-0-only sinks, reduced records,
collective stop. Each test runs ``_dist_worker.py`` as ranks 0 and 1 (forks of one start-up: ``_fork_ranks.py``) and kills both on timeout."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _ranks import launch_ranks
from trackdiag.core.record import Record
from trackdiag.rules.straggler import Straggler
from trackdiag.core.record import read_records

WORKER = Path(__file__).with_name("_dist_worker.py")
TIMEOUT = 90


def launch(scenario: str, out: Path, **env: str) -> list[dict]:
    """Run ranks 0 and 1 of ``scenario`` (:func:`_ranks.launch_ranks`); every process is gone when this returns."""
    launch_ranks(WORKER, scenario, out, 2, TIMEOUT, **env)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], str | None]:
    out = tmp_path_factory.mktemp("ddp")
    uri = None
    try:
        import trackdiag.sinks.mlflow.sink  # noqa: F401
        import mlflow  # noqa: F401

        uri = f"sqlite:///{out / 'mlflow.db'}"
    except ImportError:
        pass
    return out, launch("ddp", out, **({"TD_MLFLOW_URI": uri} if uri else {})), uri


@pytest.mark.slow
def test_ddp_grad_norm_equals_single_process(ddp_run) -> None:
    out, ranks, _ = ddp_run
    records = list(read_records(out / "run"))
    got = {s: v for r in records for k, s, v in r.points() if k == "diag/grad/global_norm"}
    ref = ranks[0]["ref_norms"]
    assert sorted(got) == list(range(len(ref)))
    for step, v in enumerate(ref):
        assert got[step] == pytest.approx(v, rel=1e-5), step
    # the loss series is the mean over ranks: the full-batch loss (equal shards)
    loss = {s: v for r in records for s, v in r.series.get("diag/loss", [])}
    for step, v in enumerate(ranks[0]["ref_losses"]):
        assert loss[step] == pytest.approx(v, rel=1e-5)
    keys = set().union(*(r.scalars for r in records))
    assert not any("module." in k for k in keys)
    assert {"diag/grad/norm/0", "diag/grad/norm/2", "diag/dist/world_size"} <= keys
    assert set(records[-1].tables["diag/dist/per_rank/step_time_ms"]) == {"0", "1"}


@pytest.mark.slow
def test_one_tracker_run_and_one_local_record(ddp_run) -> None:
    out, _, uri = ddp_run
    assert [p.parent.name for p in out.rglob("records.jsonl")] == ["run"]
    assert len(list(out.rglob("run.json"))) == 1
    if uri is None:
        pytest.skip("mlflow sink not importable: checked the local record only")
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("dist")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    assert "diag/grad/global_norm" in runs[0].data.metrics


@pytest.mark.slow
def test_nan_on_rank1_stops_both_ranks_at_the_same_step(tmp_path: Path) -> None:
    ranks = launch("nan", tmp_path)
    assert ranks[0]["stopped_at"] == ranks[1]["stopped_at"] == 8  # NaN at step 5, judged at the next logging step (every=4: 8)
    for r in ranks:
        alert = next(a for a in r["alerts"] if a["kind"] == "nonfinite_loss")
        assert (alert["step"], alert["where"]) == (5, "rank 1")
        assert "rank 1" in alert["message"]
    written = [json.loads(line) for line in (tmp_path / "run" / "alerts.jsonl").read_text().splitlines()]
    assert any(a["kind"] == "nonfinite_loss" and a["where"] == "rank 1" for a in written)


@pytest.mark.slow
def test_fsdp2_grad_norm_equals_clip_grad_norm(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.fsdp", reason="no FSDP in this torch")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard (FSDP2) missing in this torch")
    ranks = launch("fsdp", tmp_path)
    records = list(read_records(tmp_path / "run"))
    got = {r.step: r.scalars for r in records if "diag/grad/norm/0" in r.scalars}
    norms = {s: v for r in records for k, s, v in r.points() if k == "diag/grad/global_norm"}
    for step, (clip, layer0) in enumerate(zip(ranks[0]["clip_norms"], ranks[0]["layer0"])):
        assert norms[step] == pytest.approx(clip, rel=1e-5), step
        assert got[step]["diag/grad/norm/0"] == pytest.approx(layer0, rel=1e-5), step
    assert ranks[0]["clip_norms"] == ranks[1]["clip_norms"]


def test_straggler_rule_names_the_slow_rank() -> None:
    rule = Straggler(factor=1.5, patience=2)
    rec = Record(step=3, tables={"diag/dist/per_rank/step_time_ms": {"0": 10.0, "1": 31.0, "2": 11.0}})
    assert rule.check(rec, [], []) == []  # one slow window is noise
    (alert,) = rule.check(rec, [], [])
    assert alert.where == "rank 1" and alert.kind == "straggler"
    assert rule.check(Record(step=3, tables={"diag/dist/per_rank/step_time_ms": {"0": 10.0, "1": 12.0}}), [], []) == []
    assert rule.check(Record(step=3), [], []) == []

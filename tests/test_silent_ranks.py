"""Runs that are quietly wrong across ranks (issue 45 items 5 and 6): DDP replicas whose weights part, and
ranks that read the same batches. Each test runs ``_rank_sync_worker.py`` as 2 or 4 gloo processes on
loopback (CPU; forks of one start-up: ``_fork_ranks.py``) and reads back what every rank saw; the rule
tests at the end need no process group."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from _ranks import launch_ranks
from trackdiag.capture.context import Component
from trackdiag.capture.layers import LayerIndex
from trackdiag.core.record import Record
from trackdiag.rules.ranks import RanksDiverged, RanksSameData

WORKER = Path(__file__).with_name("_rank_sync_worker.py")
TIMEOUT = 180
EVERY, EDIT_AT, STEPS = 2, 5, 14  # as in the worker
LOGGED = list(range(0, STEPS, EVERY))


def launch(scenario: str, out: Path, world: int) -> list[dict]:
    """Run every rank of ``scenario`` (:func:`_ranks.launch_ranks`); every process is gone when this returns."""
    launch_ranks(WORKER, scenario, out, world, TIMEOUT)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def kinds(rank: dict, prefix: str = "ranks_") -> list[tuple[str, int, str, str]]:
    return [(a["kind"], a["step"], a["severity"], a["where"]) for a in rank["alerts"] if a["kind"].startswith(prefix)]


def measured(rank: dict, key: str) -> dict[int, float]:
    return {int(s): v[key] for s, v in rank["logged"].items() if key in v}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_healthy_ddp_with_distributed_sampler_is_silent(tmp_path: Path, world: int) -> None:
    ranks = launch("healthy", tmp_path, world)
    for r in ranks:
        assert kinds(r) == []
        # measured at every logging step, and found equal weights and different batches
        assert measured(r, "diag/ranks/param_layers_differ") == {s: 0.0 for s in LOGGED}
        assert measured(r, "diag/ranks/same_batch") == {s: 0.0 for s in LOGGED}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_weights_edited_on_one_rank_diverge_on_every_rank(tmp_path: Path, world: int) -> None:
    ranks = launch("edit", tmp_path, world)
    at = min(s for s in LOGGED if s >= EDIT_AT)
    before = max(s for s in LOGGED if s < at)
    for r in ranks:
        assert kinds(r) == [("ranks_diverged", at, "critical", "2")]  # layer '2' of the Sequential
        alert = next(a for a in r["alerts"] if a["kind"] == "ranks_diverged")
        assert f"last agreed at logging step {before}" in alert["message"]
        assert "first in module order '2'" in alert["message"]
        if world > 2:  # a majority: the edited rank is named alone
            assert f"rank(s) {world - 1} off the others" in alert["message"]
        assert measured(r, "diag/ranks/param_layers_differ")[before] == 0.0
    assert len({json.dumps(r["alerts"], sort_keys=True) for r in ranks}) == 1  # the same alert on every rank


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["replaced", "nosync"])
def test_unsynchronised_gradients_diverge_from_the_first_logging_step(tmp_path: Path, scenario: str) -> None:
    ranks = launch(scenario, tmp_path, 2)
    where = "2" if scenario == "replaced" else "0"  # replaced: only layer 2's weight escapes the all-reduce
    for r in ranks:
        assert kinds(r) == [("ranks_diverged", 0, "critical", where)]
        alert = next(a for a in r["alerts"] if a["kind"] == "ranks_diverged")
        assert "agreed at none of the logging steps" in alert["message"]


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "world"), [("samedata", 4), ("fsdp_samedata", 2)])
def test_same_batches_on_every_rank(tmp_path: Path, scenario: str, world: int) -> None:
    ranks = launch(scenario, tmp_path, world)
    third = LOGGED[2]  # patience 3
    for r in ranks:
        assert kinds(r) == [("ranks_same_data", third, "warning", "batch")]
        assert measured(r, "diag/ranks/same_batch") == {s: 1.0 for s in LOGGED}
        if scenario == "fsdp_samedata":  # sharded weights: nothing replicated to compare
            assert measured(r, "diag/ranks/param_layers_differ") == {}


@pytest.mark.slow
def test_fsdp2_with_distributed_sampler_is_silent(tmp_path: Path) -> None:
    for r in launch("fsdp_healthy", tmp_path, 2):
        assert kinds(r) == []
        assert measured(r, "diag/ranks/same_batch") == {s: 0.0 for s in LOGGED}


def test_same_data_needs_consecutive_logging_steps() -> None:
    rule, comps = RanksSameData(patience=3), [Component("", None, None, LayerIndex.build(None, [], 8))]
    same = {"diag/ranks/same_batch": 1.0, "diag/dist/world_size": 2.0}
    assert rule.check(Record(step=0, scalars=same), [], comps) == []
    assert rule.check(Record(step=10, scalars=same), [], comps) == []
    assert rule.check(Record(step=20, scalars={"diag/ranks/same_batch": 0.0}), [], comps) == []  # streak broken
    assert rule.check(Record(step=30, scalars=same), [], comps) == []
    assert rule.check(Record(step=40, scalars=same), [], comps) == []
    (alert,) = rule.check(Record(step=50, scalars=same), [], comps)
    assert (alert.step, alert.severity) == (50, "warning") and "since step 30" in alert.message
    assert rule.check(Record(step=60, scalars=same), [], comps) == []  # reported once per streak


def test_diverged_reports_once_until_the_ranks_agree_again() -> None:
    rule, comps = RanksDiverged(), [Component("G", None, None, LayerIndex.build(None, [], 8))]
    agree = {"diag/G/ranks/param_layers_differ": 0.0}
    apart = Record(step=20, scalars={"diag/G/ranks/param_layers_differ": 2.0},
                   tables={"diag/G/ranks/param_diff": {"enc.0": 0.5, "head": 0.1},
                           "diag/G/ranks/param_rank_diff": {"0": 0.0, "1": 0.0, "2": 0.5}})
    assert rule.check(Record(step=10, scalars=agree), [], comps) == []
    (alert,) = rule.check(apart, [], comps)
    assert (alert.kind, alert.step, alert.severity, alert.where) == ("ranks_diverged", 20, "critical", "G.enc.0")
    assert "rank(s) 2 off the others" in alert.message and "last agreed at logging step 10" in alert.message
    assert rule.check(Record(step=30, scalars=apart.scalars, tables=apart.tables), [], comps) == []

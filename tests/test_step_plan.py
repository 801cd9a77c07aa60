"""The step plan (trackdiag/session/step_plan.py): a non-logging step asks no schedule and calls only the probes
with per-step work, and the run it makes is the run that asking every schedule on every step makes."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

import trackdiag
from trackdiag.core.record import read_records
from trackdiag.session.budget_policy import Budget
from trackdiag.util.schedule import NEVER, SCAN, EarlyThenEvery, Every, Never, SpreadThenEvery, Strided, next_due

SCHEDULES = [Every(7), Every(1), Never(), EarlyThenEvery(10, 50), SpreadThenEvery(500, 10), SpreadThenEvery(100, 1),
             Strided(Every(10), 30), Strided(SpreadThenEvery(500, 10), 100), Strided(Never(), 20),
             Strided(EarlyThenEvery(10, 50), 20), Strided(lambda s: s % 7 == 3, 5), lambda s: s % 13 == 5, lambda s: False]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: getattr(type(s), "__name__", "fn"))
def test_next_due_is_the_first_step_the_schedule_fires_on(schedule):
    """Against a scan of the schedule itself, from every step of a run's start and from random far steps."""
    rng = random.Random(0)
    for step in [*range(0, 1200), *(rng.randrange(10**7) for _ in range(300))]:
        want = next((t for t in range(step + 1, step + SCAN + 1) if schedule(t)), None)
        got = next_due(schedule, step)
        if want is None:
            assert got == NEVER or got > step + SCAN, (step, got)
        else:
            assert got == want, (step, got, want)


def _run(tmp_path, level: str, planned: bool, steps: int = 260, spike_at: int = 137, shed_at: int | None = None,
         scaler: bool = False):
    """A small classifier whose recorded loss spikes 1000-fold at ``spike_at`` (an anomaly window follows); ``planned=False`` makes every step ask
    the schedules (the step plan's check off). Returns (logged steps, alerts as (kind, step), the session)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = torch.amp.GradScaler("cpu", enabled=True) if scaler else None
    g = torch.Generator().manual_seed(1)
    w = torch.randn(8, 3, generator=g)
    diag = trackdiag.Diagnostics(model, opt, amp, level=level, sinks=["local"], output_dir=str(tmp_path / f"{level}{planned}"),
                                 budget=None, probes={"report": {"enabled": False}, "landscape": {"enabled": False}})
    if not planned:
        diag._plain_step = lambda step: False
        replan = diag._replan

        def unplanned_hooks() -> None:  # the optimizer hooks call every probe, as on a logging step
            replan()
            diag._pre_plain = diag._post_plain = diag._grad_plain = None

        diag._replan = unplanned_hooks
    logged = []
    with diag:
        for step in range(steps):
            x = torch.randn(16, 8, generator=g)
            y = (x @ w).argmax(1)
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            if amp is not None:
                amp.scale(loss).backward()
                amp.step(opt)
                amp.update()
            else:
                loss.backward()
                opt.step()
            if step == shed_at:  # the cost budget stretching the cadence mid-run, as it does at a logging step
                diag._shed(step, "every x5", Budget(0.01, ["every x5"], taken=[{"step": step, "shed": "every x5"}]))
            before = diag._history[-1].step if diag._history else -1
            diag.step(loss * 1000 if step == spike_at else loss, outputs=out, batch=(x, y))
            if diag._history and diag._history[-1].step != before:
                logged.append(diag._history[-1].step)
    return logged, sorted((a.kind, a.step) for a in diag.alerts), diag


def _points(run_dir) -> dict[tuple[str, int], float]:
    clocks = ("perf/", "overhead", "time", "memory", "rss")
    return {(k, s): v for r in read_records(run_dir) for k, s, v in r.points() if not any(c in k for c in clocks)}


@pytest.mark.parametrize("level,shed_at", [("basic", None), ("advanced", None), ("advanced", 120), ("extreme", None)])
def test_the_planned_run_logs_and_alerts_exactly_as_asking_every_step(tmp_path, level, shed_at):
    planned = _run(tmp_path, level, True, shed_at=shed_at)
    asked = _run(tmp_path, level, False, shed_at=shed_at)
    assert planned[0] == asked[0] and len(planned[0]) > 5
    assert planned[1] == asked[1]
    # every metric point the same (a probe skipped on a step where it had work would change some): the clocks aside
    mine, theirs = _points(tmp_path / f"{level}True"), _points(tmp_path / f"{level}False")
    assert mine.keys() == theirs.keys() and len(mine) > 100
    assert [k for k in mine if mine[k] != theirs[k]] == []
    assert any(kind == "loss_spike" and step == 137 for kind, step in planned[1]), planned[1]
    if level == "advanced":  # an anomaly window (basic has none): every step after the alert is a logging step
        raised = min(s for s in planned[0] if s >= 137)
        assert {raised + 1, raised + 2} <= set(planned[0])


def test_probes_with_nothing_to_do_are_not_called_and_a_scaler_makes_its_probe_busy(tmp_path):
    _, _, plain = _run(tmp_path, "basic", True, steps=60)
    busy = {p.name for p in plain._busy}
    assert "loss" in busy and "scaler" not in busy and "setup" not in busy, busy
    # the optimizer hooks' plain-step lists: no due-only probe, no set-up check once done; the mode check stays
    assert {p.name for p in plain._pre_plain} == {"modes"}, plain._pre_plain
    _, _, adv = _run(tmp_path, "advanced", True, steps=60)
    assert not any(p.due_only for p in (*adv._pre_plain, *adv._post_plain, *adv._grad_plain))
    assert {"updates", "histograms", "gradflow"} & {p.name for p in adv._grad_probes + adv._pre_probes + adv._post_probes}
    _, _, amp = _run(tmp_path, "basic", True, steps=60, scaler=True)
    assert "scaler" in {p.name for p in amp._busy}

"""``optimizer_idle``: backward passes reach the model and its optimizer no longer steps (``optimizer.step()`` dropped,
a gradient-accumulation condition that never holds). Before it, ``basic`` said nothing at all and ``advanced`` raised
``stale_params`` 50 steps after the onset.

Each fault is planted at step ``ONSET`` (or from the first step): the first alert of warning or worse must be
``optimizer_idle`` at that step. Loops that give ``step()`` every micro-batch of a gradient accumulation, or whose
generator's optimizer starts after a critic's warm-up while its graph is reached, raise nothing."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trackdiag

ONSET, STEPS = 60, 130


def _session(model, opt, out: Path, level: str = "advanced", accum: int = 1) -> trackdiag.Diagnostics:
    """A session; ``accum`` > 1: gradients carried over that many ``step()`` calls, as the zero-grad check is told for
    a loop that gives ``step()`` every micro-batch."""
    probes = {"report": {"enabled": False}, **({"zerograd": {"accumulation_steps": accum}} if accum > 1 else {})}
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), budget=None,
                                 probes=probes)


def classify(out: Path, fault: str, *, level: str = "advanced", onset: int = ONSET, accum: int = 1,
             steps: int = STEPS) -> trackdiag.Diagnostics:
    """A learnable 4-class problem, Adam; ``step()`` given every micro-batch. ``fault``: ``no_step`` (the loop stops
    calling ``optimizer.step()`` from ``onset``), ``never_holds`` (accumulation over ``accum`` micro-batches stepped
    under ``i % accum == accum``, which never holds), ``none``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    w = torch.randn(20, 4)
    diag = _session(model, opt, out, level, accum)
    with diag:
        for i in range(steps):
            x = torch.randn(64, 20)
            y = (x @ w).argmax(1)
            out_ = model(x)
            loss = nn.functional.cross_entropy(out_, y) / accum
            loss.backward()
            due = i % accum == accum if fault == "never_holds" else (i + 1) % accum == 0
            if due and not (fault == "no_step" and i >= onset):
                opt.step()
                opt.zero_grad(set_to_none=True)
            elif fault == "no_step" and i >= onset:
                opt.zero_grad(set_to_none=True)
            diag.step(loss, outputs=out_, batch=(x, y))
    return diag


def _loud(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_dropped_step_is_raised_at_its_step(tmp_path, level: str) -> None:
    diag = classify(tmp_path, "no_step", level=level)
    loud = _loud(diag)
    assert loud and (loud[0].kind, loud[0].step, loud[0].severity) == ("optimizer_idle", ONSET, "critical"), \
        [(a.kind, a.step, a.severity) for a in loud]
    assert "before that it stepped at every step" in loud[0].message and "no longer reached" in loud[0].message


def test_an_accumulation_condition_that_never_holds_is_raised_from_the_first_step(tmp_path) -> None:
    diag = classify(tmp_path, "never_holds", level="basic", accum=4)
    loud = _loud(diag)
    assert loud and (loud[0].kind, loud[0].step) == ("optimizer_idle", 0), [(a.kind, a.step) for a in loud]
    assert "it has never stepped" in loud[0].message and "never reached" in loud[0].message


@pytest.mark.parametrize("accum", [1, 8])
def test_accumulation_with_step_given_every_micro_batch_is_silent(tmp_path, accum: int) -> None:
    """step() every micro-batch, the optimizer every 8th: runs of 7 steps without an optimizer step are the rhythm."""
    diag = classify(tmp_path, "none", accum=accum, steps=200)
    assert not [a for a in diag.alerts if a.kind == "optimizer_idle"], [(a.kind, a.step) for a in diag.alerts]
    assert not _loud(diag), [(a.kind, a.step, a.message) for a in _loud(diag)]


def test_a_slower_rhythm_that_stops_is_raised(tmp_path) -> None:
    """Accumulation over 4 micro-batches, each given to step(); the optimizer step dropped at ``ONSET``: raised once the
    run is past 3x the rhythm's gap (3 steps), at its first step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), 0.05)
    w = torch.randn(20, 4)
    diag = _session(model, opt, tmp_path, "basic", 4)
    with diag:
        for i in range(STEPS):
            x = torch.randn(64, 20)
            loss = nn.functional.cross_entropy(model(x), (x @ w).argmax(1)) / 4
            loss.backward()
            if (i + 1) % 4 == 0 and i < ONSET:
                opt.step()
                opt.zero_grad()
            diag.step(loss, batch=x)
    idle = [a for a in diag.alerts if a.kind == "optimizer_idle"]
    assert [(a.step, a.severity) for a in idle] == [(ONSET, "critical")], [(a.kind, a.step) for a in diag.alerts]
    assert "at least every 4 steps" in idle[0].message


def test_a_generator_whose_optimizer_starts_after_the_critics_warm_up_is_silent(tmp_path) -> None:
    """The critic's loss reaches the generator (its fakes not detached) for 60 steps before the generator's optimizer
    first steps: a backward pass reaches it at every step, its optimizer idle from its first step by design."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    d = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_g, opt_d = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    diag = trackdiag.Diagnostics({"G": g, "D": d}, {"G": opt_g, "D": opt_d}, level="basic", sinks=["local"],
                                 output_dir=str(tmp_path), budget=None, probes={"report": {"enabled": False}})
    bce = nn.functional.binary_cross_entropy_with_logits
    with diag:
        for it in range(150):
            real = torch.randn(64, 2) * 0.3 + 2
            fake = g(torch.randn(64, 4))
            opt_d.zero_grad()
            opt_g.zero_grad()
            d_loss = bce(d(real), torch.ones(64, 1)) + bce(d(fake), torch.zeros(64, 1))
            d_loss.backward()
            opt_d.step()
            g_loss = torch.zeros(())
            if it >= 60:
                opt_g.zero_grad()
                g_loss = bce(d(g(torch.randn(64, 4))), torch.ones(64, 1))
                g_loss.backward()
                opt_g.step()
            diag.step({"G": g_loss, "D": d_loss}, batch=real)
    assert not [a for a in diag.alerts if a.kind == "optimizer_idle"], [(a.kind, a.step) for a in diag.alerts]

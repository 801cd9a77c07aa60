"""Hand-written updates through ``p.data`` between backward passes are parameter updates.

OpenAI's Reptile sine-wave demo trains the meta-model in place: per outer iteration 15 inner steps of
``model.zero_grad(); loss.backward(); param.data -= lr * param.grad.data``, then the weights are
interpolated back, and the loop logs once per outer iteration (``Diagnostics(model, None)``,
``diag.step`` per outer iteration). ``p.data -= ...`` bumps no version counter, so the zero-grad
probe saw 15 passes into reset gradients "with the parameters unchanged between them" and raised
``accumulation_reset`` critical at step 0 of a healthy run. A component no optimizer steps now keeps
the sum of its sentinel's values per pass; passes with different values are not one accumulation
window. The mistake itself (passes zeroed between them, then one hand-written update) is still
critical at its first step.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import trackdiag
from _zoo_a import one_thread, quiet_probes
from trackdiag.capture.grad_records import Pass
from trackdiag.probes.zerograd import wiped

LEVELS = ["basic", "advanced", "extreme"]


def reptile(tmp_path, level: str, mistake: bool = False, iterations: int = 40) -> trackdiag.Diagnostics:
    """Reptile in place on sine waves (the demo's sizes, fewer iterations). ``mistake``: the inner
    passes are accumulated for one update at the end, but ``zero_grad()`` sits before each backward."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x_all = torch.linspace(-5, 5, 50)[:, None]
    model = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    diag = trackdiag.Diagnostics(model, None, level=level, sinks=["local"], output_dir=str(tmp_path),
                                 probes=quiet_probes())
    with one_thread(), diag:
        for it in range(iterations):
            before = copy.deepcopy(model.state_dict())
            phase, ampl = float(torch.rand((), generator=g)) * 6.28, 0.1 + 4.9 * float(torch.rand((), generator=g))
            y_all = torch.sin(x_all + phase) * ampl
            losses = []
            for _ in range(3):
                for idx in torch.randperm(50, generator=g).split(10):
                    model.zero_grad()
                    loss = (model(x_all[idx]) - y_all[idx]).pow(2).mean()
                    loss.backward()
                    if not mistake:
                        for p in model.parameters():
                            p.data -= 0.02 * p.grad.data
                    losses.append(loss.detach())
            if mistake:  # one update from what is left: the last pass's gradients
                for p in model.parameters():
                    p.data -= 0.02 * p.grad.data
            after = model.state_dict()
            frac = 1.0 - it / iterations
            model.load_state_dict({k: before[k] + (after[k] - before[k]) * frac for k in before})
            diag.step(torch.stack(losses).mean())
    return diag


@pytest.mark.parametrize("level", LEVELS)
def test_reptile_in_place_is_not_an_accumulation_reset(tmp_path, level) -> None:
    diag = reptile(tmp_path, level)
    assert not [a for a in diag.alerts if a.kind in ("accumulation_reset", "grads_not_zeroed")], diag.alerts


@pytest.mark.parametrize("level", LEVELS)
def test_passes_zeroed_before_one_hand_written_update_are_still_the_mistake(tmp_path, level) -> None:
    diag = reptile(tmp_path, level, mistake=True)
    found = [(a.kind, a.severity, a.step) for a in diag.alerts if a.kind == "accumulation_reset"]
    assert found == [("accumulation_reset", "critical", 0)], diag.alerts


def test_wiped_reads_the_values_where_the_versions_cannot_tell() -> None:
    """The same version counter: equal sums are one window (two resets: wiped), different sums are not;
    passes without values are judged by the version counter alone, as before."""
    one, two = torch.tensor(1.0), torch.tensor(2.0)
    assert bool(wiped([Pass(True, 5, True, one), Pass(True, 5, True, one.clone())]))
    assert not bool(wiped([Pass(True, 5, True, one), Pass(True, 5, True, two)]))
    assert not bool(wiped([Pass(True, 5, True, one), Pass(True, 5, True, two), Pass(True, 5, True, one)]))
    assert bool(wiped([Pass(True, 5, True, one), Pass(True, 5, True, two), Pass(True, 5, True, two)]))
    assert wiped([Pass(True, 5), Pass(True, 5)]) is True
    assert wiped([Pass(True, 5), Pass(True, 6)]) is False

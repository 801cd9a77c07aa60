"""``targets_from_outputs``: the class targets are the model's own predictions (``y = out.argmax(1)``, or pseudo-labels
taken from the same forward pass). Nothing crashes; the loss falls fast and the model learns nothing but to agree
with itself. Found at the first step whose outputs and targets are handed over, at every preset. Silent: real labels,
and a model resumed after training (it agrees with its labels too, but at a loss near 0, not at chance)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


def _data(steps: int):
    g = torch.Generator().manual_seed(1)
    protos = torch.rand(10, 64, generator=g)
    for _ in range(steps):
        y = torch.randint(0, 10, (64,), generator=g)
        yield (protos[y] + 0.2 * torch.rand(64, 64, generator=g)).clamp(0, 1), y


def _train(model, tmp_path, level: str, steps: int, own: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    agree = []
    with trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=OFF) as diag:
        for x, y in _data(steps):
            out = model(x)
            if own:
                y = out.argmax(1)  # the bug
            agree.append(float((out.argmax(1) == y).float().mean()))
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag, agree


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_targets_taken_from_the_outputs_are_found_at_step_0(tmp_path, level) -> None:
    diag, agree = _train(_model(), tmp_path, level, 60, own=True)
    found = [a for a in diag.alerts if a.kind == "targets_from_outputs"]
    assert len(found) == 1 and found[0].step == 0 and found[0].severity == "critical", found
    assert "all 64 class targets" in found[0].message, found[0].message
    rec = next(r for r in read_records(tmp_path) if "diag/task/targets_from_outputs" in r.scalars)
    assert rec.scalars["diag/task/targets_agree"] == agree[0] == 1.0  # the share, as the loop itself counts it


def test_real_labels_and_a_trained_model_resumed_are_silent(tmp_path) -> None:
    model = _model()
    diag, agree = _train(model, tmp_path / "fresh", "advanced", 300, own=False)
    assert agree[0] < 0.3 and agree[-1] > 0.95  # it learns: by the end it agrees with its labels on nearly all
    assert not [a for a in diag.alerts if a.kind == "targets_from_outputs"]
    resumed, agree = _train(model, tmp_path / "resumed", "advanced", 30, own=False)  # the trained weights, a new run
    assert agree[0] == 1.0  # every target its own prediction, as in the bug: the loss near 0 tells them apart
    assert not [a for a in resumed.alerts if a.severity != "info"], [(a.kind, a.step) for a in resumed.alerts]

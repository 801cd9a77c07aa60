"""Missing labels marked NaN and masked out of the loss (torchxrayvision's multi-dataset chest X-ray training,
MoleculeNet/Tox21 multi-task loaders): the batch holds NaN at every step, by design, and the run is healthy.
``nonfinite_input`` says so as an ``info`` finding; the same NaN reaching the loss is critical at its step."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import trackdiag

K = 4


def _run(tmp_path, masked: bool, nan_from: int = 0, steps: int = 60, level: str = "advanced"):
    """Multi-label BCE over K pathologies; two sources, each leaves one pathology unlabelled (NaN) from
    step ``nan_from`` on. ``masked``: the loss skips them per task (``mask = ~isnan(target)``)."""
    torch.manual_seed(0)
    w = torch.randn(16, K)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, K))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    bce = nn.BCEWithLogitsLoss()
    diag = trackdiag.Diagnostics(model, opt, level=level, every=10, sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}, "histograms": {"enabled": False}})
    losses = []
    with diag:
        for step in range(steps):
            x = torch.randn(64, 16)
            y = (x @ w > 0.8).float()
            if step >= nan_from:
                y[:32, 3] = float("nan")
                y[32:, 0] = float("nan")
            out = model(x)
            if masked:
                loss = sum(bce(out[:, t][~torch.isnan(y[:, t])], y[:, t][~torch.isnan(y[:, t])]) for t in range(K))
            else:
                loss = bce(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
            losses.append(loss.item())
    return diag, losses


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_masked_missing_labels_are_an_info_finding(tmp_path, level: str) -> None:
    """At ``extreme`` also: the pre-flight's guessed loss (BCE against the NaN targets) is NaN where the training
    step's is finite, which says nothing about the model (inconclusive, not a critical ``preflight``), and the
    NaN replay does not run for data the loop handles (it said "the NaN/Inf arises in the loss function")."""
    diag, losses = _run(tmp_path, masked=True, level=level)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]  # the reference: healthy, learning
    found = [a for a in diag.alerts if a.kind == "nonfinite_input"]
    assert [(a.step, a.severity, a.where) for a in found][:1] == [(0, "info", "input batch[1]")]
    assert "stayed finite" in found[0].message and "NaN replay" not in found[0].message
    assert not [a for a in diag.alerts if a.severity != "info"]


def test_nan_labels_that_reach_the_loss_are_critical_at_their_step(tmp_path) -> None:
    diag, losses = _run(tmp_path, masked=False, nan_from=23, steps=30)
    assert math.isfinite(losses[22]) and math.isnan(losses[23])  # the reference
    first = {a.kind: a for a in reversed(diag.alerts)}
    assert (first["nonfinite_input"].step, first["nonfinite_input"].severity) == (23, "critical")
    assert (first["nonfinite_loss"].step, first["nonfinite_loss"].severity) == (23, "critical")

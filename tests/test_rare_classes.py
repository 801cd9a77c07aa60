"""A healthy classifier of rare positives is no mode collapse.

The Kaggle credit-card-fraud tutorials' MLP (2 logits, plain cross-entropy, 0.6 % positives, batch 512)
predicts the majority class for > 99 % of every batch because > 99 % of every batch *is* the majority
class; ``mode_collapse`` warned twice per run ("100% of the batch predicts a single class"). The rule now
compares the predictions with the batch's own labels (``out/label_top_fraction``): a collapse is the other
classes predicted for under half the rows they hold. A model stuck on one class is still caught, on the rare
classes' data as on balanced data.
"""
from __future__ import annotations

import torch
from torch import nn

import trackdiag
from _zoo_a import one_thread, quiet_probes


def fraud(tmp_path, stuck: bool = False, steps: int = 320, pos_rate: float = 0.006) -> trackdiag.Diagnostics:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(30, generator=g)
    model = nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))
    if stuck:  # a head that cannot move, biased to the majority class: always class 0
        with torch.no_grad():
            model[-1].weight.zero_()
            model[-1].bias.copy_(torch.tensor([5.0, -5.0]))
        model[-1].requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 probes=quiet_probes())
    with one_thread(), diag:
        for _ in range(steps):
            x = torch.randn(512, 30, generator=g)
            y = (torch.rand(512, generator=g) < pos_rate).long()
            x[y == 1] += w / w.norm() * 8
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag


def test_rare_positives_predicted_as_rarely_are_no_collapse(tmp_path) -> None:
    diag = fraud(tmp_path)
    assert not [a for a in diag.alerts if a.kind == "mode_collapse"], diag.alerts


def test_a_model_stuck_on_the_majority_class_is_still_a_collapse(tmp_path) -> None:
    diag = fraud(tmp_path, stuck=True, pos_rate=0.2)
    found = [(a.kind, a.severity) for a in diag.alerts if a.kind == "mode_collapse"]
    assert found[:1] == [("mode_collapse", "warning")], diag.alerts

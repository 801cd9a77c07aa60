"""A silent error no issue named: a bounding activation left at the end of a classifier (``activation_before_ce``).

``nn.Sequential(..., nn.Linear(64, 10), nn.ReLU())`` (or ``nn.Sigmoid()``, ``nn.Tanh()``) trained with
``CrossEntropyLoss``. Nothing crashes. Measured on the digits MLP: a final ReLU takes the accuracy from 88 % to 56 %
(a zeroed score gets no gradient, so its class is never predicted for that input again), a sigmoid holds the loss
above ``log(1 + 9/e)`` = 1.46 (it ends at 1.63 where the plain model reaches 0.21). The build before raised nothing.

Now ``activation_before_ce``, critical, at step 0, every preset; the table's share of zeroed scores is checked against
the scores themselves. Healthy twins, silent: the logits straight from the Linear, a ReLU inside the model,
soft-capped logits (``30 * tanh(z / 30)``, Gemma's), and a sigmoid before ``BCELoss`` (binary, judged elsewhere).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_silent_softmax_dim import _loud, _run
from trackdiag.core.record import read_records


class SoftCap(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh(z / 30.0)


@pytest.mark.parametrize("head", ["relu", "sigmoid", "tanh"])
def test_a_bounding_activation_before_cross_entropy_is_found(tmp_path, head: str) -> None:
    module = {"relu": nn.ReLU(), "sigmoid": nn.Sigmoid(), "tanh": nn.Tanh()}[head]
    diag, (out, y, loss) = _run(tmp_path, F.cross_entropy, head=module)
    found = [a for a in diag.alerts if a.kind == "activation_before_ce"]
    assert [(a.step, a.severity, a.where) for a in found] == [(0, "critical", "loss")], _loud(diag)
    assert _loud(diag)[0][0] == "activation_before_ce", _loud(diag)
    table = next(r.tables["diag/data/loss_form"] for r in read_records(tmp_path) if "diag/data/loss_form" in r.tables)
    assert table["loss"] == pytest.approx(F.cross_entropy(out.double(), y).item(), rel=1e-6)
    assert table["at_zero"] == pytest.approx((out == 0).double().mean().item())
    if head == "relu":
        assert f"{table['at_zero']:.0%} of them are exactly 0" in found[0].message and "ReLU" in found[0].message
    else:
        width = 1.0 if head == "sigmoid" else 2.0
        assert f"{math.log(1 + 9 * math.exp(-width)):.3g}" in found[0].message, found[0].message
    assert "remove the final nn.Sigmoid / nn.ReLU / nn.Tanh" in found[0].hint


@pytest.mark.parametrize("level", ["basic", "extreme"])
def test_found_at_every_preset(tmp_path, level: str) -> None:
    diag, _ = _run(tmp_path, F.cross_entropy, head=nn.ReLU(), level=level)
    assert [(a.kind, a.step) for a in diag.alerts if a.kind == "activation_before_ce"] == [("activation_before_ce", 0)]


@pytest.mark.parametrize("head", ["none", "soft_cap"])
def test_unbounded_or_capped_logits_are_silent(tmp_path, head: str) -> None:
    diag, _ = _run(tmp_path, F.cross_entropy, head=SoftCap() if head == "soft_cap" else None)
    assert not [a for a in diag.alerts if a.kind == "activation_before_ce"], _loud(diag)
    tables = [r.tables["diag/data/loss_form"] for r in read_records(tmp_path) if "diag/data/loss_form" in r.tables]
    assert tables and all("activation" not in t for t in tables)  # measured, no activation found

"""A silent error no issue named: hidden layers initialised to one value (``symmetric_units``).

``nn.init.constant_(layer.weight, 0.05)`` (or ``zeros_``) on every layer: each hidden unit gets the same weights, so
the same gradient, and the units never differ: the network learns what one unit per layer can. Nothing crashes.

Before: ``not_learning`` at chance with no cause (a tanh MLP), or the symptoms only (``grad_flow``, ``dead_units``,
``mode_collapse`` for zeros under ReLU). Now ``symmetric_units`` (warning) names the layers, at every preset; the
probe's table is checked against the weights themselves. Healthy twins, silent: the default init, a zero-initialised
classifier head, a LoRA-style adapter (``B`` zeros, ``A`` random), a zero-initialised residual branch, a frozen
averaging filter, and the corpus's styles (tests/test_styles.py).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from conftest import batches
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


class Residual(nn.Module):
    """x + fc2(relu(fc1(x))), fc2 zero-initialised (the residual branch starts as the identity)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        nn.init.zeros_(self.fc2.weight)
        nn.init.zeros_(self.fc2.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class LoRA(nn.Module):
    """A frozen base layer plus B @ A, B zeros, A random (the LoRA init)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A, self.B = nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False)
        nn.init.zeros_(self.B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.B(self.A(x))


class Pooled(nn.Module):
    """A frozen 3-tap averaging filter (every weight 1/3) before a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.smooth = nn.Conv1d(1, 4, 3, padding=1, bias=False)
        nn.init.constant_(self.smooth.weight, 1 / 3)
        self.smooth.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(4 * 64, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.smooth(x.unsqueeze(1)).flatten(1))


def _mlp(act: type[nn.Module] = nn.Tanh) -> nn.Sequential:
    return nn.Sequential(nn.Linear(64, 64), act(), nn.Linear(64, 64), act(), nn.Linear(64, 10))


def _init(model: nn.Module, fill: Callable[[torch.Tensor], None]) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            fill(m.weight)
            nn.init.zeros_(m.bias)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {
    "constant_tanh": lambda: _init(_mlp(), lambda w: nn.init.constant_(w, 0.05)),
    "zeros_relu": lambda: _init(_mlp(nn.ReLU), nn.init.zeros_),
    "default": _mlp,
    "zero_head": lambda: _zero_head(_mlp(nn.ReLU)),
    "residual_zero_branch": lambda: nn.Sequential(nn.Linear(64, 64), Residual(64), nn.ReLU(), nn.Linear(64, 10)),
    "lora_adapter": lambda: nn.Sequential(LoRA(64, 64), nn.ReLU(), nn.Linear(64, 10)),
    "frozen_average": Pooled,
}


def _zero_head(model: nn.Sequential) -> nn.Module:
    nn.init.zeros_(model[-1].weight)
    return model


def _run(tmp_path, digits, name: str, level: str = "advanced", steps: int = 120):
    x, y = digits
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        data = batches(x, y)
        for _ in range(steps):
            xb, yb = next(data)
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
    return diag, model


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("name", ["constant_tanh", "zeros_relu"])
def test_layers_initialised_to_one_value_are_found(tmp_path, digits, name: str, level: str) -> None:
    diag, model = _run(tmp_path, digits, name, level)
    found = [a for a in diag.alerts if a.kind == "symmetric_units"]
    assert [(a.severity, a.where) for a in found] == [("warning", "0 (Linear)")], diag.alerts
    every = 50 if level == "basic" else 10
    assert found[0].step == 2 * every, found[0]  # the second check after the weights moved
    # zeros under ReLU: no hidden unit ever fires, so the head's weights stay 0 too (its biases learn the classes)
    want = {"0": 64.0, "2": 64.0} if name == "constant_tanh" else {"0": 64.0, "2": 64.0, "4": 10.0}
    named = ", ".join(f"{k} (Linear)" for k in want)
    assert "64 output units" in found[0].message and f"Same in {len(want)} layers: {named}" in found[0].message
    # the record against the weights themselves: exactly these layers, each with all its rows equal
    tables = [r.tables["diag/model/symmetric_units"] for r in read_records(tmp_path)
              if "diag/model/symmetric_units" in r.tables]
    assert tables and all(t == want for t in tables), tables
    for i, m in enumerate(model):
        if isinstance(m, nn.Linear):
            same = bool((m.weight - m.weight[:1]).abs().max() <= 1e-6 * max(m.weight.abs().max().item(), 1e-30))
            assert same == (str(i) in tables[-1]), (i, same)


@pytest.mark.parametrize("name", ["default", "zero_head", "residual_zero_branch", "lora_adapter", "frozen_average"])
def test_healthy_inits_are_silent(tmp_path, digits, name: str) -> None:
    diag, _ = _run(tmp_path, digits, name)
    assert not [a for a in diag.alerts if a.kind == "symmetric_units"], diag.alerts
    checks = [r.scalars["diag/model/symmetry_checks"] for r in read_records(tmp_path)
              if "diag/model/symmetry_checks" in r.scalars]
    assert checks and max(checks) == 4  # measured, and found nothing


def test_spread_and_scale_are_the_weights_own() -> None:
    """What the probe hands over for each weight equals, bitwise, the spread across the units computed another way
    (``aminmax`` over the units) and the largest magnitude (``abs().amax()``): a Linear, a Conv2d, a weight with one
    unit constant and one that is symmetric."""
    from trackdiag.capture.components import build_components
    from trackdiag.capture.context import ProbeContext
    from trackdiag.probes.symmetry import SymmetryProbe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 40), nn.ReLU(), nn.Linear(40, 5))
    ctx = ProbeContext(build_components(model, torch.optim.SGD(model.parameters(), lr=0.1), 64), 10, 64, None)
    probe = SymmetryProbe()
    assert probe.collect(ctx) == {}  # no weight has moved yet: nothing measured
    with torch.no_grad():  # every weight moves (its version counter): measured from now on
        model[0].weight.mul_(1.5)
        model[2].weight[3] = 0.25  # one unit constant
        model[4].weight.copy_(model[4].weight[0].expand(5, 40))  # every unit the same
    got = probe.collect(ctx)["spread"]
    want = []
    for w in (model[0].weight, model[2].weight, model[4].weight):
        low, high = torch.aminmax(w.detach().reshape(w.shape[0], -1), dim=0)
        want.append(torch.stack([(high - low).amax(), w.detach().abs().amax()]))
    assert torch.equal(got, torch.stack(want)), (got, want)
    assert got[2, 0] == 0 and got[0, 0] > 0

"""``grads_overclipped``: ``clip_grad_norm_`` with a ``max_norm`` far below the gradient's norm clips every SGD step to a
sliver of itself. Nothing crashes and every norm looks tame; the run crawls (here it sits at chance level, which
``not_learning`` says without the cause). Found at the first measured step of three in a row, with the clip
coefficient checked against ``clip_grad_norm_``'s own return value. Silent: SGD clipped at 1.0 (only its first steps
are), Adam clipped to a sliver (the scale is divided out), and no clipping at all."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.core.record import read_records
from _clip import clip_checked

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


def _train(tmp_path, level: str, max_norm: float | None, adam: bool = False, steps: int = 160):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3) if adam else \
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    w = torch.randn(20, 5, generator=g)
    returned: dict[int, float] = {}
    with trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=OFF) as diag:
        for step in range(steps):
            x = torch.randn(64, 20, generator=g)
            y = (x @ w).argmax(1)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            if max_norm is not None:
                returned[step] = float(clip_checked(model.parameters(), max_norm))
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag, returned


def _warned(diag) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


@pytest.mark.parametrize("level, checks", [("basic", (0, 50, 100)), ("advanced", (0, 10, 20))])
def test_sgd_clipped_to_a_sliver_every_step_is_found_at_its_first_check(tmp_path, level, checks) -> None:
    diag, returned = _train(tmp_path, level, 1e-4)
    found = [a for a in diag.alerts if a.kind == "grads_overclipped"]
    assert len(found) == 1 and found[0].severity == "warning" and found[0].step == checks[0], found
    assert f"from {checks[0]} to {checks[-1]}" in found[0].message and "SGD (lr 0.1)" in found[0].message, found[0].message
    # the coefficient each check recorded is clip_grad_norm_'s own: max_norm over the norm it returned
    coefs = {r.step: r.scalars["diag/grad/clip_coef"] for r in read_records(tmp_path) if "diag/grad/clip_coef" in r.scalars}
    for step in checks:
        assert coefs[step] == pytest.approx(1e-4 / returned[step], rel=1e-3), (step, coefs[step], returned[step])
    assert "grads_overclipped" in [a.kind for a in _warned(diag)][:1]  # the cause comes first, not_learning after


@pytest.mark.parametrize("max_norm, adam", [(1.0, False), (1e-4, True), (None, False)])
def test_clipping_spikes_adam_and_no_clipping_are_silent(tmp_path, max_norm, adam) -> None:
    diag, returned = _train(tmp_path, "advanced", max_norm, adam=adam)
    assert not [a for a in diag.alerts if a.kind == "grads_overclipped"], [(a.kind, a.step) for a in diag.alerts]
    if max_norm == 1.0:  # the SGD run did get clipped, at its start: the rule saw coefficients below 1
        assert any(v > 1.0 for v in returned.values())
    assert not _warned(diag), [(a.kind, a.severity, a.step) for a in diag.alerts]

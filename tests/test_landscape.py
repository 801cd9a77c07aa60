"""Loss landscape: closed-form values on a quadratic, filter normalisation, exact restoration, CLI."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from trackdiag.cli import main as cli_main
from trackdiag.core.errors import TrackdiagError
from trackdiag.forensics.landscape import filter_normalized_direction, grid_steps, loss_landscape, norm_params


def _quadratic() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A linear least-squares model: its MSE is a quadratic function of the weights."""
    torch.manual_seed(0)
    model = nn.Linear(6, 3, bias=True).double()
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 3, dtype=torch.float64)
    return model, (x, y)


def test_quadratic_grid_matches_closed_form() -> None:
    model, (x, y) = _quadratic()
    res = loss_landscape(model, (x, y), "mse", dims=2, steps=7, span=0.8, seed=3)
    (d1w, d1b), (d2w, d2b) = res.directions
    assert torch.count_nonzero(d1b) == 0 and torch.count_nonzero(d2b) == 0  # biases are not moved
    w, b = model.weight.detach(), model.bias.detach()
    # L(a, b) = mean((R + a E1 + b E2)^2) = c + 2a <R,E1> + 2b <R,E2> + a^2 |E1|^2 + 2ab <E1,E2> + b^2 |E2|^2
    r, e1, e2 = x @ w.T + b - y, x @ d1w.T, x @ d2w.T
    m = lambda u, v: float((u * v).mean())  # noqa: E731
    coef = (m(r, r), 2 * m(r, e1), 2 * m(r, e2), m(e1, e1), 2 * m(e1, e2), m(e2, e2))
    got = np.asarray(res.losses)
    assert got.shape == (7, 7) and res.evals == 49
    for i, beta in enumerate(res.betas):
        for j, alpha in enumerate(res.alphas):
            want = (coef[0] + coef[1] * alpha + coef[2] * beta + coef[3] * alpha**2 + coef[4] * alpha * beta
                    + coef[5] * beta**2)
            assert got[i, j] == pytest.approx(want, rel=1e-10)
    assert res.center_loss == pytest.approx(coef[0], rel=1e-12)


def test_filter_normalisation_matches_direct_computation() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.Flatten(), nn.Linear(5 * 4, 4), nn.LayerNorm(4))
    params = list(model.parameters())
    dirs = filter_normalized_direction(params, torch.Generator().manual_seed(7), norm_params(model))
    gen = torch.Generator().manual_seed(7)
    for p, d in zip(params, dirs):
        raw = torch.randn(p.shape, generator=gen)
        if p.dim() <= 1:
            assert torch.count_nonzero(d) == 0  # biases and norm-layer params
            continue
        for i in range(p.shape[0]):  # filter i: same direction, rescaled to |w_i|
            want = raw[i] * (p[i].detach().norm() / (raw[i].norm() + 1e-10))
            torch.testing.assert_close(d[i], want)
            assert float(d[i].norm()) == pytest.approx(float(p[i].detach().norm()), rel=1e-5)


def test_weights_buffers_and_modes_restored_bit_for_bit() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 4))
    x, y = torch.randn(20, 8), torch.randint(0, 4, (20,))
    model.train()
    model(x).sum().backward()  # realistic state: running stats moved, grads present
    model[1].eval()  # a mixed train/eval state must come back as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    res = loss_landscape(model, (x, y), "cross_entropy", dims=1, steps=9, span=2.0)
    assert len(res.losses) == 9 and all(math.isfinite(v) for v in res.losses)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # params and BN running stats/num_batches
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    with pytest.raises(TrackdiagError):
        loss_landscape(model, x, "mse")  # not an (inputs, targets) batch


def test_grid_budget_rounds_to_odd() -> None:
    assert grid_steps(2, 21, 100) == 9
    assert grid_steps(1, 21, 10) == 9
    assert grid_steps(2, 10, None) == 9


def test_cli_writes_png_and_json(tmp_path, capsys) -> None:
    model, batch = _quadratic()
    torch.save(model, tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "state.pt")
    torch.save(batch, tmp_path / "batch.pt")
    rc = cli_main(["landscape", str(tmp_path / "model.pt"), "--batch", str(tmp_path / "batch.pt"), "--loss", "mse",
                   "--steps", "5", "--out", str(tmp_path / "out"), "--no-progress"])
    assert rc == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    data = json.loads((tmp_path / "out" / "landscape.json").read_text())
    assert data["dims"] == 2 and len(data["losses"]) == 5 and info["evals"] == 25
    assert (tmp_path / "out" / "landscape.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a state dict needs --factory; with it, the same centre loss
    assert cli_main(["landscape", str(tmp_path / "state.pt"), "--batch", str(tmp_path / "batch.pt")]) == 2
    rc = cli_main(["landscape", str(tmp_path / "state.pt"), "--batch", str(tmp_path / "batch.pt"), "--loss", "mse",
                   "--factory", f"{__name__}:_double_linear", "--dims", "1", "--steps", "3",
                   "--out", str(tmp_path / "o2"), "--no-progress"])
    assert rc == 0
    again = json.loads((tmp_path / "o2" / "landscape.json").read_text())
    assert again["center_loss"] == pytest.approx(data["center_loss"], rel=1e-12)


def _double_linear() -> nn.Module:
    return nn.Linear(6, 3).double()

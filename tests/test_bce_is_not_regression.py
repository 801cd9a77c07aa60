"""Per-pixel binary cross-entropy on 0/1 float targets of the outputs' shape (a PixelCNN, a binarised VAE) is
not a regression, even at a step where it equals the logits' MSE.

The task is shown by the loss at one of the first steps: the MSE of the outputs against float targets of
their shape makes it a regression whose chance level is the targets' variance p(1-p). A PixelCNN's BCE was
0.5648 against that MSE's 0.5622 at step 1 (within the 2 % tolerance), and its fitted loss (0.147 nats)
sat next to p(1-p) (0.146), 3x below the real chance level (H(p), 0.47 nats): ``not_learning`` warned "no
better than a model that ignores its input". The binary cross-entropy of the same pair is now a candidate
too: a loss as close to it as to the MSE is left unknown. A true MSE regression is still one
(``test_mse_is_still_a_regression``)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread
from trackdiag.alerts.task import decide

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
D, P = 8, 16


def _batch(w: torch.Tensor, gen: torch.Generator, bs: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(bs, D, generator=gen)
    return x, torch.bernoulli(torch.sigmoid(1.5 * (x @ w) - 2.2), generator=gen)  # ~34 % ones, noisy pixels


def _bias_where_bce_is_mse(p: float) -> float:
    """The constant logit at which BCE equals MSE for targets with a share ``p`` of ones."""
    def gap(z: float) -> float:
        return p * math.log1p(math.exp(-z)) + (1 - p) * math.log1p(math.exp(z)) - (p * (1 - z) ** 2 + (1 - p) * z ** 2)
    lo, hi = -1.0, 0.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if gap(mid) > 0 else (mid, hi)
    return lo


def test_pixel_bce_that_matches_mse_at_a_step_raises_no_not_learning(tmp_path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(D, P, generator=gen) * 1.2
    p = float(_batch(w, gen, 4096)[1].mean())
    model = nn.Linear(D, P)
    nn.init.zeros_(model.weight)
    nn.init.constant_(model.bias, _bias_where_bce_is_mse(p))  # BCE == MSE at step 0: the coincidence, planted
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    losses = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for _ in range(800):
            x, y = _batch(w, gen)
            out = model(x)
            loss = F.binary_cross_entropy_with_logits(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
            losses.append(float(loss))
    chance = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert sum(losses[-50:]) / 50 < 0.5 * chance  # it learned: far below the marginal entropy
    assert [(a.kind, a.severity) for a in diag.alerts if a.severity != "info"] == [], [a.message for a in diag.alerts]


def test_mse_is_still_a_regression() -> None:
    got = {"mse": 0.80, "var": 0.25, "n": 64.0, "bce": 0.95}
    assert decide(0.801, got, -1).kind == "regression"
    assert decide(0.951, got, -1).kind == "unknown"  # the BCE's value: not the MSE's task
    assert decide(0.80, {**got, "bce": 0.805}, -1).kind == "regression"  # both close: the nearer one decides
    assert decide(0.7999, {**got, "bce": 0.7999}, -1).kind == "unknown"

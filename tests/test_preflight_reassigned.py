"""The pre-flight's "trainable parameters not in the optimizer" (critical, unambiguous) on a model whose forward
re-creates a parameter at every call: zalando's VQ-VAE ``VectorQuantizerEMA`` assigns its EMA-updated codebook as
a new ``nn.Parameter`` in each training forward. The new objects require grad, are in no optimizer and never get
a gradient (the straight-through estimator bypasses them; the EMA updates them): nothing is wrong, yet the check
said "they get gradients but never change". It now asks for the gradient the step's backward left: none while
the model's other parameters have theirs is a note. A head left out of the optimizer is still the failure, at the
automatic pre-flight (it has a gradient) and when the pre-flight is called before training (no evidence either
way: as before)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import trackdiag


class EMACodebook(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.codes = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin(x)
        with torch.no_grad():
            idx = torch.cdist(z, self.codes).argmin(1)
        if self.training:  # the EMA update, re-assigned as a new Parameter (as the VQ-VAE does)
            self.codes = nn.Parameter(0.99 * self.codes + 0.01 * z.detach().mean(0))
        q = self.codes[idx]
        return z + (q - z).detach()  # straight-through: no gradient reaches the codebook


def train(tmp_path: Path, model: nn.Module, params) -> list:
    opt = torch.optim.Adam(params, 1e-3)
    diag = trackdiag.Diagnostics(model, opt, level="extreme", sinks=["local"], output_dir=str(tmp_path / "run"),
                                 probes={"report": {"enabled": False}, "landscape": {"enabled": False}})
    with diag:
        for _ in range(12):
            x = torch.randn(32, 8)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=x)
    return [a for a in diag.alerts if a.kind == "preflight"]


def test_a_parameter_re_created_in_forward_is_no_optimizer_fault(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(EMACodebook(), nn.Linear(8, 1))
    found = train(tmp_path, model, model.parameters())
    assert [a for a in found if a.where.startswith("optimizer")] == [], [(a.severity, a.where, a.message) for a in found]


def test_a_head_left_out_of_the_optimizer_still_fails(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    found = train(tmp_path, model, model[0].parameters())  # the head is left out
    assert [(a.severity, a.where) for a in found if a.where.startswith("optimizer")] == [("critical", "optimizer:2.weight")]
    before = trackdiag.Diagnostics(model, torch.optim.Adam(model[0].parameters()), level="basic", sinks=[],
                                   output_dir=str(tmp_path / "before"))
    report = before.preflight((torch.randn(16, 8), torch.randn(16, 1)), forward=lambda m, b: m(b[0]),
                              loss_fn=lambda out, b: (out - b[1]).pow(2).mean())
    before.close()
    assert report["optimizer"].ok is False  # called before training: no gradients anywhere, the old verdict

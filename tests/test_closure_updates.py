"""What ``optimizer.step(closure)`` does to the weights inside the closure, before its forward, is not the
optimizer's update.

PyTorch's neural style transfer tutorial optimises the input image with LBFGS; its closure clamps the image to
[0, 1] (``input_img.data.clamp_(0, 1)``) before evaluating it. Started from white noise (the tutorial's
alternative), that first clamp moves the image by ~0.75 of its size, and the update probe, which copied the
weights at the optimizer's pre-step hook, took it for the step: ``update_ratio`` critical at step 0 of a healthy
run. For ``step(closure)`` the weights are now copied at the closure's first backward pass.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread, quiet_probes


class Image(nn.Module):
    """The optimised image as the one parameter of a module (what trackdiag is given)."""

    def __init__(self, start: torch.Tensor) -> None:
        super().__init__()
        self.img = nn.Parameter(start)

    def forward(self) -> torch.Tensor:
        return self.img


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_a_clamp_inside_the_closure_is_not_the_lbfgs_update(tmp_path, level) -> None:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).requires_grad_(False)
    content = 0.3 + 0.4 * torch.rand(1, 3, 16, 16)
    target = features(content)
    holder = Image(torch.randn(1, 3, 16, 16))  # white noise, as the tutorial's alternative start
    opt = torch.optim.LBFGS(holder.parameters())
    diag = trackdiag.Diagnostics(holder, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=quiet_probes())
    losses = []
    with one_thread(), diag:
        for _ in range(12):
            def closure() -> torch.Tensor:
                with torch.no_grad():
                    holder.img.clamp_(0, 1)
                opt.zero_grad()
                loss = F.mse_loss(features(holder()), target)
                loss.backward()
                return loss
            loss = opt.step(closure)
            with torch.no_grad():
                holder.img.clamp_(0, 1)
            losses.append(float(loss))
            diag.step(loss)
    assert losses[-1] < 0.2 * losses[0]  # it fits
    assert not [a for a in diag.alerts if a.kind == "update_ratio" and a.severity != "info"], diag.alerts

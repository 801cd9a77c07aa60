"""A normalizing flow in the style of the ``normflows`` package's RealNVP examples: affine coupling
layers (an MLP predicts tanh-bounded log-scales and shifts for one half from the other), swaps
between them, a standard-normal base, ``loss = model.forward_kld(x)`` (the negative mean
log-likelihood of a fresh batch from the target: two moons, scaled by 0.5, noise 0.05), Adam with
weight decay 1e-5 (lr 2e-3: the examples use 5e-4 over thousands of iterations; at 5e-3 a gradient spike
knocks the NLL back for ~20 steps once in a while, a real instability trackdiag reports), and the examples'
guard ``if ~(torch.isnan(loss) | torch.isinf(loss)): loss.backward(); optimizer.step()``.
trackdiag gets ``diag.step(loss)`` after the guard.

Mechanisms: a loss (NLL of a density) that crosses zero and ends **negative** (~2 down to ~-0.3),
fresh samples every step (no epochs, no validation set), a script that skips the step on a
non-finite loss.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, session, wipe_grads, jump_factor, lr_jump, stop_if_nonfinite)

NAME = "normalizing_flow"
DESCRIPTION = "normflows RealNVP examples: affine couplings on two moons, loss = forward_kld (NLL, goes negative)"
FAULTS = {
    "nan": "log(0) inside the second coupling's MLP `flows.2.net` from onset (the script's guard skips the steps)",
    "lr1000": "Adam lr x1000 from onset",
    "crash_lr": "Adam lr x1e6 from onset; the script stops once the loss is not finite (in place of the example's skip guard)",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
}
NUM_SAMPLES = 128


def two_moons(n: int, gen: torch.Generator, noise: float = 0.05, scale: float = 0.5) -> torch.Tensor:
    t = torch.rand(n, generator=gen) * math.pi
    upper = torch.rand(n, generator=gen) < 0.5
    x = torch.where(upper, torch.cos(t), 1 - torch.cos(t))
    y = torch.where(upper, torch.sin(t), 0.5 - torch.sin(t))
    pts = torch.stack([x - 0.5, y - 0.25], dim=1) + noise * torch.randn(n, 2, generator=gen)
    return pts * scale


class AffineCoupling(nn.Module):
    """z2' = z2 * exp(s(z1)) + t(z1), log|det| = sum(s); inverse for the data-to-latent pass."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1, hidden), nn.LeakyReLU(), nn.Linear(hidden, hidden), nn.LeakyReLU(),
                                 nn.Linear(hidden, 2))
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def inverse(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z1, z2 = z[:, :1], z[:, 1:]
        s, t = self.net(z1).chunk(2, dim=1)
        s = torch.tanh(s)
        return torch.cat([z1, (z2 - t) * torch.exp(-s)], dim=1), -s.sum(dim=1)


class Permute(nn.Module):
    def inverse(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return z.flip(1), torch.zeros(z.shape[0])


class NormalizingFlow(nn.Module):
    def __init__(self, num_layers: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(num_layers):
            layers += [AffineCoupling(), Permute()]
        self.flows = nn.ModuleList(layers)

    def log_prob(self, x: torch.Tensor) -> torch.Tensor:
        log_q = torch.zeros(x.shape[0])
        z = x
        for flow in reversed(self.flows):
            z, log_det = flow.inverse(z)
            log_q = log_q + log_det
        return log_q - 0.5 * (z**2).sum(dim=1) - math.log(2 * math.pi)

    def forward_kld(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.mean(self.log_prob(x))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = NormalizingFlow()
    model.flows[2].net = NanGate(model.flows[2].net)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3 * (1000 if fault == "lr_start" else 1), weight_decay=1e-5)
    losses: list[float] = []
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for it in range(steps):
            if lr_jump(fault, it, onset):
                bump_lr(optimizer, jump_factor(fault))
            model.flows[2].net.arm(active(fault, "nan", it, onset))
            if not active(fault, "no_zero", it, onset):
                optimizer.zero_grad()
            x = two_moons(NUM_SAMPLES, gen)
            loss = model.forward_kld(x)
            stop_if_nonfinite(fault, loss)
            if ~(torch.isnan(loss) | torch.isinf(loss)):
                loss.backward()
                if active(fault, "wiped_grads", it, onset):
                    wipe_grads(model.parameters())
                optimizer.step()
            losses.append(loss.item())
            diag.step(loss)
    progress = Progress("NLL", mean(losses[:10]), mean(losses[-10:]), min_gain=1.0)
    return StyleRun(diag, fault_onset(fault, onset), steps, "flows.2.net", fault, progress, crash["error"],
                    timer.seconds)

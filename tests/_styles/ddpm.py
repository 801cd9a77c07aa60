"""A denoising diffusion model in the style of lucidrains' ``denoising-diffusion-pytorch``: a
``GaussianDiffusion`` module wraps the denoiser and its **forward returns the loss** (random
timestep per sample, noise added by the cosine schedule, MSE of the predicted noise), and the
``Trainer`` loop does ``loss = diffusion(data) / accumulate`` over 2 micro-batches, clips at 1.0,
steps Adam (betas 0.9/0.99), zeroes, and updates an EMA copy. trackdiag gets ``diag.step(loss)``
only: no outputs, no batch. Data: digits scaled to [-1, 1] (64 "pixels"), an MLP denoiser with a
sinusoidal time embedding.

Mechanisms: the model returns its own loss, a loss that is noisy by construction (random
timesteps: it falls from ~1 to ~0.35 with a wide spread), accumulation, clipping, EMA.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, mean, one_thread, session, wipe_grads, jump_factor, lr_jump, stop_if_nonfinite)
from ._common import PullBack

NAME = "ddpm"
DESCRIPTION = "lucidrains denoising-diffusion-pytorch: GaussianDiffusion.forward returns the loss, diag.step(loss) only"
FAULTS = {
    "nan": "log(0) inside the denoiser's second layer `model.net.2` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "crash_lr": "Adam lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "opt.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) instead of 1.0 from onset",
    "reversed_ema": "from onset a reversed EMA update pulls the denoiser (not its EMA copy) toward a copy taken at onset after each step",
}
TIMESTEPS, ACCUMULATE = 200, 2


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        freqs = torch.exp(torch.arange(half) * -(math.log(10000) / (half - 1)))
        emb = t.float()[:, None] * freqs[None, :]
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class Denoiser(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128, tdim: int = 32) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(SinusoidalPosEmb(tdim), nn.Linear(tdim, tdim), nn.SiLU())
        self.net = nn.Sequential(nn.Linear(dim + tdim, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                                 nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat((x, self.time_mlp(t)), dim=-1))


def cosine_beta_schedule(timesteps: int, s: float = 0.008) -> torch.Tensor:
    x = torch.linspace(0, timesteps, timesteps + 1, dtype=torch.float64)
    alphas_cumprod = torch.cos(((x / timesteps) + s) / (1 + s) * math.pi * 0.5) ** 2
    alphas_cumprod = alphas_cumprod / alphas_cumprod[0]
    return torch.clip(1 - (alphas_cumprod[1:] / alphas_cumprod[:-1]), 0, 0.999)


class GaussianDiffusion(nn.Module):
    def __init__(self, model: nn.Module, timesteps: int = TIMESTEPS) -> None:
        super().__init__()
        self.model = model
        self.num_timesteps = timesteps
        alphas_cumprod = torch.cumprod(1.0 - cosine_beta_schedule(timesteps), dim=0)
        self.register_buffer("sqrt_alphas_cumprod", alphas_cumprod.sqrt().float())
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1.0 - alphas_cumprod).sqrt().float())

    def q_sample(self, x_start: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return self.sqrt_alphas_cumprod[t, None] * x_start + self.sqrt_one_minus_alphas_cumprod[t, None] * noise

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, self.num_timesteps, (img.shape[0],))
        noise = torch.randn_like(img)
        model_out = self.model(self.q_sample(img, t, noise), t)
        return F.mse_loss(model_out, noise)


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, _, _ = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    diffusion = GaussianDiffusion(Denoiser())
    diffusion.model.net[2] = NanGate(diffusion.model.net[2])
    opt = torch.optim.Adam(diffusion.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1), betas=(0.9, 0.99))
    ema = copy.deepcopy(diffusion).eval().requires_grad_(False)
    dl = batches(xtr * 2 - 1, ytr, 32, gen)
    losses: list[float] = []
    pull = PullBack(fault, onset, diffusion)
    diag = session(diffusion, opt, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(opt, jump_factor(fault))
            diffusion.model.net[2].arm(active(fault, "nan", step, onset))
            total_loss = torch.zeros(())
            for _ in range(ACCUMULATE):
                data, _labels = next(dl)
                loss = diffusion(data) / ACCUMULATE
                stop_if_nonfinite(fault, loss)
                total_loss += loss.detach()
                loss.backward()
            max_norm = 0.0 if active(fault, "wiped_grads", step, onset) else 1.0
            if max_norm == 0.0:
                wipe_grads(diffusion.parameters())
            else:
                torch.nn.utils.clip_grad_norm_(diffusion.parameters(), max_norm)
            opt.step()
            pull(step)
            if not active(fault, "no_zero", step, onset):
                opt.zero_grad()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), diffusion.parameters()):
                    pe.lerp_(pm, 1 - 0.995)
            losses.append(float(total_loss))
            diag.step(total_loss)
    progress = Progress("train loss", mean(losses[:10]), mean(losses[-30:]), min_gain=0.2)
    return StyleRun(diag, fault_onset(fault, onset), steps, "model.net.2", fault, progress, crash["error"],
                    timer.seconds)

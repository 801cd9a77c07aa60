"""A VAE in the style of PyTorch's ``examples/vae/main.py``: an MLP encoder to (mu, logvar), the
reparameterisation trick, a sigmoid decoder, and a loss that is a per-batch **sum** (BCE summed over
pixels and samples + the KL term), so the loss is in the thousands and scales with the batch. The
digit labels ride along unused in ``batch=(x, y)`` as the README's quick start shows; the outputs
passed are reconstructions (probabilities over 64 pixels, not class logits). Validation per epoch is
the example's ``test()``: the summed loss divided by the number of samples (per-sample, so ~60x
smaller than the training loss).

Mechanisms: loss scale (sum reduction), outputs that are not logits, unused integer labels.
A NaN anywhere makes ``binary_cross_entropy`` raise, so the NaN fault here is ``crash_nan``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, mean, one_thread, session, wipe_grads, SAME_BATCH, restart_loader, lr_jump,
                      freeze_all_but_last, orphan_params, jump_factor, stop_if_nonfinite, DUP_WORKERS)
from ._common import PullBack

NAME = "vae_sum"
DESCRIPTION = "pytorch/examples vae/main.py: BCE(sum)+KL per batch on digits, Adam, unused labels in batch"
FAULTS = {
    "crash_nan": "log(0) in the encoder's first layer `fc1` from onset: binary_cross_entropy raises",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; test loss every 20 steps",
    "crash_lr": "Adam lr x1e6 from onset: the next forward overflows and binary_cross_entropy raises",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "runaway": "from onset the KL term subtracted (its sign flipped, a KL weight annealed below zero)",
    "detached": "the output of the encoder's first layer `fc1` detached: it never gets a gradient",
    "frozen_majority": "every parameter but the last (the decoder's output bias) frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "reversed_ema": "from onset a reversed EMA update pulls the VAE toward a copy taken at onset after each step",
}


class VAE(nn.Module):
    def __init__(self, d: int = 64, hidden: int = 128, latent: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc21 = nn.Linear(hidden, latent)
        self.fc22 = nn.Linear(hidden, latent)
        self.fc3 = nn.Linear(latent, hidden)
        self.fc4 = nn.Linear(hidden, d)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.encode(x.view(-1, 64))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def loss_function(recon_x: torch.Tensor, x: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
                  kl_weight: float = 1.0) -> torch.Tensor:
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld if kl_weight == 1.0 else bce + kl_weight * kld


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = VAE()
    model.fc1 = NanGate(model.fc1)
    model.fc1.cut = fault == "detached"
    freeze_all_but_last(model, fault)
    bsz = 64
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    if fault == "tiny_subset":
        xtr, ytr = xtr[: 2 * bsz], ytr[: 2 * bsz]
    epoch = len(xtr) // bsz
    eval_every = 20 if fault == "tiny_subset" else epoch
    loader = batches(xtr, ytr, bsz, gen)
    loader = restart_loader(loader, fault, onset)
    losses: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault))
            model.fc1.arm(active(fault, "crash_nan", step, onset))
            data, labels = next(loader)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            recon_batch, mu, logvar = model(data)
            loss = loss_function(recon_batch, data, mu, logvar, -1.0 if active(fault, "runaway", step, onset) else 1.0)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            losses.append(loss.item() / len(data))
            diag.step(loss, outputs=recon_batch, batch=(data, labels))
            if step % eval_every == eval_every - 1:
                diag.log_eval(loss=_test(model, xva))
                model.train()
    progress = Progress("train loss per sample", mean(losses[:10]), mean(losses[-10:]), min_gain=5.0)
    return StyleRun(diag, fault_onset(fault, onset), steps, "fc1", fault, progress, crash["error"], timer.seconds)


@torch.no_grad()
def _test(model: VAE, xva: torch.Tensor) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(xva), 128):
        data = xva[i : i + 128]
        recon, mu, logvar = model(data)
        total += loss_function(recon, data, mu, logvar).item()
    return total / len(xva)

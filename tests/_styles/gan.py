"""A GAN in the style of PyTorch's ``examples/dcgan/main.py`` (MLP nets on the 8x8 digits scaled to
[-1, 1]): D is updated on a real and a fake batch (two backward passes, ``errD = errD_real +
errD_fake``), then G through D with real labels (D's gradients from G's backward are left there
and zeroed at D's next ``zero_grad``). Adam(2e-4, betas=(0.5, 0.999)) for each, D returns logits
and the loss is ``BCEWithLogitsLoss``. trackdiag gets the dict form of the README:
``{"G": netG, "D": netD}``, ``{"G": optG, "D": optD}``, ``loss={"G": errG, "D": errD}``.

Mechanisms: an adversarial objective (neither loss is minimised: errG rises as D improves, both
hover around ln 2..2), two components, a network whose gradients come from another's backward,
BatchNorm in G and Dropout in D.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, wipe_grads)
from ._common import PullBack

NAME = "gan"
DESCRIPTION = "pytorch/examples dcgan/main.py loop: alternating D/G Adam steps, BCEWithLogits, dict models"
FAULTS = {
    "nan": "log(0) inside G's second linear layer `main.3` from onset (component G)",
    "lr1000": "both Adam learning rates x1000 from onset",
    "lr_start": "both Adam learning rates x1000 from step 0",
    "no_zero": "netD.zero_grad() and netG.zero_grad() dropped from onset",
    "eval_mode": "netG.eval() and netD.eval() left on (BatchNorm running stats, Dropout off)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) on each net between its backward and its step from onset",
    "reversed_ema": "from onset a reversed EMA update pulls both nets toward a copy taken at onset after each step",
}
NZ = 16


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, 128), nn.BatchNorm1d(128), nn.ReLU(True),
                                  nn.Linear(128, 128), nn.BatchNorm1d(128), nn.ReLU(True), nn.Linear(128, 64), nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2, inplace=True), nn.Dropout(0.3),
                                  nn.Linear(128, 64), nn.LeakyReLU(0.2, inplace=True), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


def weights_init(m: nn.Module) -> None:
    """dcgan's init: N(0, 0.02) weights, BatchNorm N(1, 0.02)."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.BatchNorm1d):
        nn.init.normal_(m.weight, 1.0, 0.02)
        nn.init.zeros_(m.bias)


def moment_gap(fake: torch.Tensor, real: torch.Tensor) -> float:
    """How far generated pixels are from real ones: squared gaps of per-pixel means and stds."""
    return float((fake.mean(0) - real.mean(0)).pow(2).sum() + (fake.std(0) - real.std(0)).pow(2).sum())


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, _, _ = digits()
    xtr = xtr * 2 - 1  # Normalize((0.5,), (0.5,))
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    netG, netD = Generator(), Discriminator()
    netG.apply(weights_init)
    netD.apply(weights_init)
    netG.main[3] = NanGate(netG.main[3])
    lr = 2e-4 * (1000 if fault == "lr_start" else 1)
    optD = torch.optim.Adam(netD.parameters(), lr=lr, betas=(0.5, 0.999))
    optG = torch.optim.Adam(netG.parameters(), lr=lr, betas=(0.5, 0.999))
    criterion = nn.BCEWithLogitsLoss()
    bsz = 64
    fixed_noise = torch.randn(512, NZ, generator=gen)
    loader = batches(xtr, ytr, bsz, gen)
    gaps = [moment_gap(netG.eval()(fixed_noise).detach(), xtr)]
    pull = PullBack(fault, onset, netG, netD)
    diag = session({"G": netG, "D": netD}, {"G": optG, "D": optD}, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        netG.train()
        netD.train()
        if fault == "eval_mode":
            netG.eval()
            netD.eval()
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                bump_lr(optD, 1000.0)
                bump_lr(optG, 1000.0)
            netG.main[3].arm(active(fault, "nan", step, onset))
            zero = not active(fault, "no_zero", step, onset)
            wipe = active(fault, "wiped_grads", step, onset)
            real, labels = next(loader)
            # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
            if zero:
                netD.zero_grad()
            errD_real = criterion(netD(real), torch.ones(bsz))
            errD_real.backward()
            noise = torch.randn(bsz, NZ, generator=gen)
            fake = netG(noise)
            output = netD(fake.detach())
            errD_fake = criterion(output, torch.zeros(bsz))
            errD_fake.backward()
            errD = errD_real + errD_fake
            if wipe:
                wipe_grads(netD.parameters())
            optD.step()
            # (2) Update G: maximize log(D(G(z)))
            if zero:
                netG.zero_grad()
            output = netD(fake)
            errG = criterion(output, torch.ones(bsz))
            errG.backward()
            if wipe:
                wipe_grads(netG.parameters())
            optG.step()
            pull(step)
            diag.step(loss={"G": errG, "D": errD}, outputs={"G": fake, "D": output}, batch=(real, labels))
            if step % 50 == 49:
                netG.eval()
                with torch.no_grad():
                    gaps.append(moment_gap(netG(fixed_noise), xtr))
                netG.train(fault != "eval_mode")
    progress = Progress("pixel moment gap (G vs data)", gaps[0], gaps[-1], min_gain=0.5 * gaps[0])
    return StyleRun(diag, fault_onset(fault, onset), steps, "G.main.3", fault, progress, crash["error"], timer.seconds)

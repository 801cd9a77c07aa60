"""Self-supervised contrastive learning in the style of sthalles' ``SimCLR`` (``simclr.py``): two
augmented views of each image in one batch, a conv backbone + MLP projection head, the InfoNCE loss
written as **cross-entropy over (positive, negatives) logits with all-zero labels**
(``info_nce_loss`` returns ``logits, labels``), temperature 0.07, Adam(3e-4, wd 1e-4) and a cosine
schedule that starts after the first tenth of training. trackdiag gets what the script has at hand:
``outputs=logits, batch=(images, labels)``.

Mechanisms: logits whose "class 0" is the positive pair by construction (the predicted class is 0
for nearly every row once it learns, and the targets are all 0), no real labels, a loss that starts
high (~4.5) because of the low temperature, BatchNorm in the backbone.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, mean, one_thread, session, wipe_grads, Runaway, freeze_all_but_last,
                      orphan_params)
from ._common import PullBack

NAME = "contrastive_infonce"
DESCRIPTION = "sthalles/SimCLR: two views, InfoNCE as CE over logits with all-zero labels, T=0.07, Adam + cosine"
FAULTS = {
    "nan": "log(0) inside the backbone's second conv `backbone.3` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (BatchNorm frozen at init statistics)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "runaway": "from onset - beta * ||fc.0.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated conv `backbone.3` detached: the backbone never gets a gradient, the head trains",
    "frozen_majority": "every parameter but the last (the projection's bias) frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "reversed_ema": "from onset a reversed EMA update pulls the encoder toward a copy taken at onset after each step",
}
BATCH, N_VIEWS, TEMPERATURE = 24, 2, 0.07


class ResNetSimCLR(nn.Module):
    def __init__(self, out_dim: int = 32) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                      nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.backbone(x))


def augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random crop-like shift of up to 1 pixel, brightness jitter and noise: one view."""
    dy, dx = (int(v) for v in torch.randint(-1, 2, (2,), generator=gen))
    x = torch.roll(x, shifts=(dy, dx), dims=(-2, -1))
    scale = 0.7 + 0.6 * torch.rand(x.shape[0], 1, 1, 1, generator=gen)
    return (x * scale + 0.1 * torch.randn(x.shape, generator=gen)).clamp(0, 1)


def info_nce_loss(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels = torch.cat([torch.arange(BATCH) for _ in range(N_VIEWS)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    features = F.normalize(features, dim=1)
    similarity_matrix = torch.matmul(features, features.T)
    mask = torch.eye(labels.shape[0], dtype=torch.bool)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
    positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / TEMPERATURE
    return logits, torch.zeros(logits.shape[0], dtype=torch.long)


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, _, _ = digits()
    xtr = xtr.view(-1, 1, 8, 8)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResNetSimCLR()
    model.backbone[3] = NanGate(model.backbone[3])
    model.backbone[3].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-4 * (1000 if fault == "lr_start" else 1), weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps, eta_min=0)
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, model.fc[0].weight)
    criterion = nn.CrossEntropyLoss()
    loader = batches(xtr, ytr, BATCH, gen)
    losses: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        if fault == "eval_mode":
            model.eval()
        for n_iter in range(steps):
            if fault == "lr1000" and n_iter == onset:
                bump_lr(optimizer, 1000.0, scheduler)
            model.backbone[3].arm(active(fault, "nan", n_iter, onset))
            x, _ = next(loader)
            images = torch.cat([augment(x, gen) for _ in range(N_VIEWS)], dim=0)
            features = model(images)
            logits, labels = info_nce_loss(features)
            loss = runaway(criterion(logits, labels), n_iter)
            if not active(fault, "no_zero", n_iter, onset):
                optimizer.zero_grad()
            loss.backward()
            if active(fault, "wiped_grads", n_iter, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(n_iter)
            if n_iter >= steps // 10:  # "warmup for the first 10 epochs"
                scheduler.step()
            losses.append(loss.item())
            diag.step(loss, outputs=logits, batch=(images, labels))
    progress = Progress("InfoNCE loss", mean(losses[:10]), mean(losses[-10:]), min_gain=0.5)
    return StyleRun(diag, fault_onset(fault, onset), steps, "backbone.3", fault, progress, crash["error"],
                    timer.seconds)

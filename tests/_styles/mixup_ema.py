"""Image classification the way timm's ``train.py`` does it, small: Mixup/CutMix on every batch
(timm's ``Mixup``: mixup alpha 0.8, cutmix alpha 1.0, switch prob 0.5, the batch mixed with its
flip) with label smoothing 0.1, so the targets are **soft** (B, 10) float rows, the
``SoftTargetCrossEntropy`` loss, AdamW (wd 0.05) with a per-update warm-up + cosine schedule, and a
``ModelEmaV2``-style EMA copy updated after every step; the model and its EMA are validated every
20 steps. trackdiag gets ``batch=(mixed_images, soft_targets)``.

Mechanisms: soft (float) targets, a loss that cannot reach 0 (mixed targets have entropy), a
second copy of the model that runs forwards outside the optimizer, BatchNorm + Dropout.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, shuffle, wipe_grads, Runaway, StaleEval,
                      freeze_all_but_last, lr_jump, orphan_params, jump_factor, stop_if_nonfinite)
from ._common import PullBack

NAME = "mixup_ema"
DESCRIPTION = "timm train.py: mixup/cutmix soft targets + label smoothing, SoftTargetCE, AdamW+cosine, EMA copy"
FAULTS = {
    "nan": "log(0) inside the second conv `features.3` from onset",
    "lr1000": "AdamW lr (and the schedule's base lr) x1000 from onset",
    "crash_lr": "AdamW lr (and the schedule's base lr) x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "AdamW lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (BatchNorm frozen at init statistics, Dropout off)",
    "shuffled_labels": "labels shuffled within each batch before mixing",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||head weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `features.3` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last (the head's bias) frozen; AdamW over all",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
    "eval_wrong": "the model's validation runs on a copy made before training, never refreshed (the EMA's stays right)",
    "reversed_ema": "from onset a reversed EMA update pulls the model (not its EMA copy) toward a copy taken at onset after each step",
}


class SmallConvNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.GELU(),
                                      nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.GELU())
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.1), nn.Linear(32 * 4 * 4, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def one_hot(y: torch.Tensor, classes: int, smoothing: float) -> torch.Tensor:
    off = smoothing / classes
    return torch.full((len(y), classes), off).scatter_(1, y[:, None], 1.0 - smoothing + off)


class Mixup:
    """timm's Mixup in batch mode: mixup or cutmix (switch_prob) on the batch and its flip."""

    def __init__(self, seed: int, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0, switch_prob: float = 0.5,
                 label_smoothing: float = 0.1, classes: int = 10) -> None:
        self.rng = np.random.default_rng(seed)
        self.mixup_alpha, self.cutmix_alpha, self.switch_prob = mixup_alpha, cutmix_alpha, switch_prob
        self.smoothing, self.classes = label_smoothing, classes

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rng.random() < self.switch_prob:
            lam = float(self.rng.beta(self.cutmix_alpha, self.cutmix_alpha))
            h, w = x.shape[-2:]
            cut = math.sqrt(1.0 - lam)
            ch, cw = int(h * cut), int(w * cut)
            cy, cx = int(self.rng.integers(h)), int(self.rng.integers(w))
            y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
            x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)
        else:
            lam = float(self.rng.beta(self.mixup_alpha, self.mixup_alpha))
            x = x * lam + x.flip(0) * (1.0 - lam)
        target = one_hot(y, self.classes, self.smoothing)
        return x, target * lam + target.flip(0) * (1.0 - lam)


class ModelEmaV2(nn.Module):
    def __init__(self, model: nn.Module, decay: float = 0.99) -> None:
        super().__init__()
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for ema_v, model_v in zip(self.module.state_dict().values(), model.state_dict().values()):
            if ema_v.is_floating_point():
                ema_v.mul_(self.decay).add_(model_v, alpha=1.0 - self.decay)
            else:
                ema_v.copy_(model_v)


def soft_target_cross_entropy(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.sum(-target * F.log_softmax(x, dim=-1), dim=-1).mean()


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    xtr, xva = xtr.view(-1, 1, 8, 8), xva.view(-1, 1, 8, 8)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = SmallConvNet()
    model.features[3] = NanGate(model.features[3])
    model.features[3].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    model_ema = ModelEmaV2(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3 * (1000 if fault == "lr_start" else 1), weight_decay=0.05)
    warmup = max(1, steps // 30)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda u: (u + 1) / warmup if u < warmup else 0.5 * (1 + math.cos(math.pi * (u - warmup) / max(1, steps - warmup))))
    orphan_params(model, fault)
    runaway, evaluated = Runaway(fault, onset, list(model.parameters())[-2]), StaleEval(model, fault, onset)
    mixup_fn = Mixup(seed)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    loader = batches(xtr, ytr, 32, gen)
    ema_accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        if fault == "eval_mode":
            model.eval()
        for num_updates in range(steps):
            if lr_jump(fault, num_updates, onset):
                bump_lr(optimizer, jump_factor(fault), lr_scheduler)
            model.features[3].arm(active(fault, "nan", num_updates, onset))
            x, y = next(loader)
            if fault == "shuffled_labels":
                y = shuffle(y, gen)
            x, target = mixup_fn(x, y)
            output = model(x)
            loss = runaway(soft_target_cross_entropy(output, target), num_updates)
            stop_if_nonfinite(fault, loss)
            if not active(fault, "no_zero", num_updates, onset):
                optimizer.zero_grad()
            loss.backward()
            if active(fault, "wiped_grads", num_updates, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(num_updates)
            model_ema.update(model)
            lr_scheduler.step()
            diag.step(loss, outputs=output, batch=(x, target))
            if num_updates % 20 == 19:
                metrics = {}
                for tag, net in (("", evaluated.at(num_updates)), ("ema_", model_ema.module)):
                    was_training = net.training
                    net.eval()
                    with torch.no_grad():
                        logits = net(xva)
                    net.train(was_training)
                    metrics[f"{tag}loss"] = F.cross_entropy(logits, yva).item()
                    metrics[f"{tag}accuracy"] = float((logits.argmax(1) == yva).float().mean())
                diag.log_eval(**metrics)
                ema_accs.append(metrics["ema_accuracy"])
    progress = Progress("EMA val accuracy", ema_accs[0], ema_accs[-1], higher_is_better=True, min_gain=0.3)
    return StyleRun(diag, fault_onset(fault, onset), steps, "features.3", fault, progress, crash["error"],
                    timer.seconds)

"""An ``accelerate`` training loop in the style of accelerate's ``examples/complete_cv_example.py``
and ``by_feature/gradient_accumulation.py``: ``Accelerator(gradient_accumulation_steps=2)``,
``accelerator.prepare(model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)`` over real
``DataLoader``s, ``with accelerator.accumulate(model):`` around each micro-batch,
``accelerator.backward(loss)``, ``accelerator.clip_grad_norm_`` when ``sync_gradients``, AdamW with
``OneCycleLR``, and evaluation every epoch through ``accelerator.gather_for_metrics``. trackdiag is
created after ``prepare`` and ``diag.step`` is called for **every micro-batch**, as the README shows.
Data: the digits as 8x8 images; a small conv net with GroupNorm.

Mechanisms: accelerate's wrapped optimizer, scheduler and data loaders, micro-batches merged into
one trackdiag step, one-cycle schedule (the rate rises 25x, then anneals), clipping at 1.0.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, shuffle, Runaway, freeze_all_but_last, lr_jump, orphan_params, jump_factor, stop_if_nonfinite)

NAME = "accelerate_cv"
DESCRIPTION = "accelerate complete_cv_example + gradient_accumulation: prepare(), accumulate(), clip, OneCycleLR"
FAULTS = {
    "nan": "log(0) inside the second conv `features.3` from onset",
    "lr1000": "OneCycleLR's max/initial/min lr x1000 from onset",
    "crash_lr": "OneCycleLR's max/initial/min lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "OneCycleLR's max_lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (Dropout off)",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "accelerator.clip_grad_norm_(max_norm=0) from onset",
    "tiny_subset": "trains on two batches; evaluation every epoch",
    "runaway": "from onset - beta * ||features.0 weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `features.3` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; AdamW over all",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
}
ACCUM, BSZ = 2, 16


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                                      nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.GroupNorm(4, 16), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, TensorDataset

    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    xtr, xva = xtr.view(-1, 1, 8, 8), xva.view(-1, 1, 8, 8)
    if fault == "tiny_subset":
        xtr, ytr = xtr[: 2 * BSZ], ytr[: 2 * BSZ]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    set_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    train_dataloader = DataLoader(TensorDataset(xtr, ytr), batch_size=BSZ, shuffle=True, drop_last=True, generator=gen)
    eval_dataloader = DataLoader(TensorDataset(xva, yva), batch_size=128)
    model = ConvNet()
    model.features[3] = NanGate(model.features[3])
    model.features[3].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3 / 25)
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, model.features[0].weight)
    lr_scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3 * (1000 if fault == "lr_start" else 1),
                                                       total_steps=steps)
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler)
    accs: list[float] = []
    diag = session(model, optimizer, out, level, **diag_overrides)
    step = 0  # optimizer steps
    with crash_guard(fault) as crash, one_thread(), diag:
        while step < steps:
            model.train(fault != "eval_mode")
            for inputs, targets in train_dataloader:
                if lr_jump(fault, step, onset) and accelerator.sync_gradients:
                    bump_lr(optimizer.optimizer, jump_factor(fault))
                model.features[3].arm(active(fault, "nan", step, onset))
                if fault == "shuffled_labels":
                    targets = shuffle(targets, gen)
                with accelerator.accumulate(model):
                    outputs = model(inputs)
                    loss = runaway(F.cross_entropy(outputs, targets), step)
                    stop_if_nonfinite(fault, loss)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        wiped = active(fault, "wiped_grads", step, onset)
                        accelerator.clip_grad_norm_(model.parameters(), 0.0 if wiped else 1.0)
                    optimizer.step()
                    lr_scheduler.step()
                    if not active(fault, "no_zero", step, onset):
                        optimizer.zero_grad()
                diag.step(loss, outputs=outputs, batch=(inputs, targets))
                if accelerator.sync_gradients:
                    step += 1
                    if step >= steps:
                        break
            model.eval()
            correct, total, vloss = 0, 0, 0.0
            for inputs, targets in eval_dataloader:
                with torch.no_grad():
                    outputs = model(inputs)
                predictions, references = accelerator.gather_for_metrics((outputs.argmax(dim=-1), targets))
                vloss += F.cross_entropy(outputs, targets, reduction="sum").item()
                correct += int((predictions == references).sum())
                total += len(references)
            diag.log_eval(loss=vloss / total, accuracy=correct / total)
            accs.append(correct / total)
    progress = Progress("val accuracy", 0.1, accs[-1] if accs else 0.0, higher_is_better=True, min_gain=0.5)
    return StyleRun(diag, fault_onset(fault, onset), steps, "features.3", fault, progress, crash["error"],
                    timer.seconds)

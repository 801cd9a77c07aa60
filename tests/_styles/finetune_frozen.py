"""Transfer learning the way most fine-tuning tutorials write it: a "pretrained" backbone (a small
conv-BN net trained on digits 0-4, loaded from a state dict) is frozen with
``model.backbone.requires_grad_(False)`` **before** ``AdamW(model.parameters())`` is built, so the
optimizer holds the frozen parameters too (PyTorch skips parameters whose ``.grad`` is None); only
the new 10-class head (Dropout + Linear) trains. ``model.train()`` stays on, so the frozen backbone's
BatchNorm running statistics still move. Validation every 20 steps.

Mechanisms: a frozen part inside the optimizer on purpose, BatchNorm buffers that change while
its weights cannot, a quick start from a good backbone (the loss falls fast, then flattens).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import SORTED_DATA
from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, shuffle, wipe_grads, SAME_BATCH, restart_loader,
                      Runaway, StaleEval, lr_jump, orphan_params, jump_factor, stop_if_nonfinite, DUP_WORKERS)
from ._common import PullBack

NAME = "finetune_frozen"
DESCRIPTION = "fine-tuning tutorials: backbone.requires_grad_(False) before AdamW(model.parameters()); head trains"
FAULTS = {
    "nan": "log(0) inside the frozen backbone's second conv `backbone.3` from onset",
    "lr1000": "AdamW lr x1000 from onset",
    "crash_lr": "AdamW lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "AdamW lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (BatchNorm frozen, Dropout off)",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||head weight||^2 in the loss, beta annealed below zero",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the trainable head toward a copy taken at onset after each step",
    "sorted_data": SORTED_DATA,
}


def backbone() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten())


class Net(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.backbone = backbone()
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x.view(-1, 1, 8, 8)))


@functools.lru_cache(maxsize=None)
def pretrained_backbone(seed: int) -> dict[str, torch.Tensor]:
    """The "checkpoint": the backbone trained on digits 0-4 (150 Adam steps)."""
    xtr, ytr, _, _ = digits()
    keep = ytr < 5
    x, y = xtr[keep], ytr[keep]
    torch.manual_seed(1000 + seed)
    net = Net(classes=5)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1000 + seed)
    loader = batches(x, y, 64, gen)
    for _ in range(150):
        xb, yb = next(loader)
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.backbone.state_dict().items()}


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    with one_thread():
        state = pretrained_backbone(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Net()
    model.backbone.load_state_dict(state)
    model.backbone.requires_grad_(False)
    model.backbone[3] = NanGate(model.backbone[3])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, [p for p in model.parameters() if p.requires_grad and p.dim() >= 2][-1])
    evaluated = StaleEval(model, fault, onset)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    loader = batches(xtr, ytr, 32, gen, sort=fault == "sorted_data")
    loader = restart_loader(loader, fault, onset)
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        if fault == "eval_mode":
            model.eval()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault))
            model.backbone[3].arm(active(fault, "nan", step, onset))
            x, y = next(loader)
            if fault == "shuffled_labels":
                y = shuffle(y, gen)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            logits = model(x)
            loss = runaway(F.cross_entropy(logits, y), step)
            stop_if_nonfinite(fault, loss)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 20 == 0 or step == steps - 1:
                was_training = model.training
                net = evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    val = net(xva)
                    acc = float((val.argmax(1) == yva).float().mean())
                    diag.log_eval(loss=F.cross_entropy(val, yva).item(), accuracy=acc)
                accs.append(acc)
                model.train(was_training)
    progress = Progress("val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.2)
    return StyleRun(diag, fault_onset(fault, onset), steps, "backbone.3", fault, progress, crash["error"],
                    timer.seconds)

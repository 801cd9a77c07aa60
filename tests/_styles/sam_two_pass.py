"""Sharpness-aware minimisation as davda54/sam's ``example/train.py`` runs it, small: the ``SAM``
optimizer wraps SGD (momentum 0.9, weight decay 5e-4, ``adaptive=True``, rho 2.0); every step is two
forward/backward passes on the same batch: ``first_step(zero_grad=True)`` moves the weights to
``w + e(w)`` in place and zeroes the gradients, ``second_step(zero_grad=True)`` puts the weights back
with ``p.data = old_p`` and steps the base SGD (SAM's own ``step()`` never runs); BatchNorm keeps
running statistics on the first pass only (``momentum = 0`` on the second), the loss is the example's
per-sample smoothed cross-entropy and ``.mean()`` is passed on; StepLR on the base optimizer.

Mechanisms: an optimizer wrapper whose own step is never called (trackdiag is given SAM, the base
SGD steps the parameters), two backward passes per step with a weight perturbation in between that
no optimizer makes, parameters whose ``.data`` is replaced (not updated in place), per-sample losses.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import SORTED_DATA
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, wipe_grads, lr_jump, stop_if_nonfinite, jump_factor)

NAME = "sam_two_pass"
DESCRIPTION = "davda54/sam example: SAM(SGD) first_step/second_step, two passes per step, p.data swapped back"
FAULTS = {
    "nan": "log(0) inside the second conv `3` from onset",
    "lr1000": "the base SGD's lr (and StepLR's base lr) x1000 from onset",
    "lr_start": "the base SGD's lr x1000 from step 0",
    "no_zero": "first_step and second_step called with zero_grad=False from onset",
    "eval_mode": "model.eval() left on (BatchNorm frozen at init statistics)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between the second backward and second_step from onset",
    "crash_lr": "the base SGD's lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "sorted_data": SORTED_DATA,
}


class SAM(torch.optim.Optimizer):
    """davda54/sam's optimizer, as published."""

    def __init__(self, params: Any, base_optimizer: Any, rho: float = 0.05, adaptive: bool = False, **kwargs: Any) -> None:
        defaults = dict(rho=rho, adaptive=adaptive, **kwargs)
        super().__init__(params, defaults)
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups
        self.defaults.update(self.base_optimizer.defaults)

    @torch.no_grad()
    def first_step(self, zero_grad: bool = False) -> None:
        grad_norm = self._grad_norm()
        for group in self.param_groups:
            scale = group["rho"] / (grad_norm + 1e-12)
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.state[p]["old_p"] = p.data.clone()
                e_w = (torch.pow(p, 2) if group["adaptive"] else 1.0) * p.grad * scale.to(p)
                p.add_(e_w)  # climb to the local maximum "w + e(w)"
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad: bool = False) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.data = self.state[p]["old_p"]  # get back to "w" from "w + e(w)"
        self.base_optimizer.step()  # do the actual "sharpness-aware" update
        if zero_grad:
            self.zero_grad()

    def _grad_norm(self) -> torch.Tensor:
        shared_device = self.param_groups[0]["params"][0].device
        return torch.norm(torch.stack([((torch.abs(p) if group["adaptive"] else 1.0) * p.grad).norm(p=2).to(shared_device)
                                       for group in self.param_groups for p in group["params"] if p.grad is not None]), p=2)


def smooth_crossentropy(pred: torch.Tensor, gold: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
    n_class = pred.size(1)
    one_hot = torch.full_like(pred, fill_value=smoothing / (n_class - 1))
    one_hot.scatter_(dim=1, index=gold.unsqueeze(1), value=1.0 - smoothing)
    return F.kl_div(input=F.log_softmax(pred, dim=1), target=one_hot, reduction="none").sum(-1)


def disable_running_stats(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.backup_momentum = m.momentum
            m.momentum = 0


def enable_running_stats(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d) and hasattr(m, "backup_momentum"):
            m.momentum = m.backup_momentum


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    xtr, xva = xtr.view(-1, 1, 8, 8), xva.view(-1, 1, 8, 8)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.Flatten(), nn.Linear(32 * 16, 10))
    model[3] = NanGate(model[3])
    lr = 0.1 * (1000 if fault == "lr_start" else 1)
    optimizer = SAM(model.parameters(), torch.optim.SGD, rho=2.0, adaptive=True, lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.base_optimizer, 100, 0.2)
    loader = batches(xtr, ytr, 64, gen, sort=fault == "sorted_data")
    accs: list[float] = []
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for step in range(steps):
            model.train()
            if fault == "eval_mode":
                model.eval()
            if lr_jump(fault, step, onset):
                bump_lr(optimizer.base_optimizer, jump_factor(fault), scheduler)
            model[3].arm(active(fault, "nan", step, onset))
            zero = not active(fault, "no_zero", step, onset)
            inputs, targets = next(loader)
            enable_running_stats(model)  # first pass: BatchNorm statistics as usual
            predictions = model(inputs)
            loss = smooth_crossentropy(predictions, targets)
            stop_if_nonfinite(fault, loss)
            loss.mean().backward()
            optimizer.first_step(zero_grad=zero)
            disable_running_stats(model)  # second pass, at w + e(w): statistics left alone
            smooth_crossentropy(model(inputs), targets).mean().backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.second_step(zero_grad=zero)
            scheduler.step()
            diag.step(loss.mean(), outputs=predictions, batch=(inputs, targets))
            if step % 50 == 0 or step == steps - 1:  # from the first step: where it started
                model.eval()
                with torch.no_grad():
                    val = model(xva)
                accs.append(float((val.argmax(1) == yva).float().mean()))
                diag.log_eval(loss=float(smooth_crossentropy(val, yva).mean()), accuracy=accs[-1])
    progress = Progress("val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.2) if len(accs) > 1 else None
    return StyleRun(diag, fault_onset(fault, onset), steps, "3", fault, progress, crash["error"], timer.seconds)

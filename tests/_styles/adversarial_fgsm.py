"""Adversarial training as "Fast is better than free" (Wong et al. 2020, ``fast_adversarial``) and
the tutorials built on it write it: a random start ``delta`` in [-eps, eps] that requires grad, one
backward pass for **the input's gradient** (it fills the parameters' ``.grad`` too), one signed step
of ``delta``, then ``optimizer.zero_grad()`` and the real backward pass on ``x + delta``. SGD with
momentum, a Dropout MLP, batches of 64, clean and adversarial validation accuracy every 20 steps.

Mechanisms: two backward passes per optimizer step whose first one's parameter gradients are zeroed
on purpose (not an accumulation window), a model input that requires grad, a training loss above
the clean loss.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import SORTED_DATA
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, shuffle, wipe_grads, Runaway, StaleEval, freeze_all_but_last,
                      lr_jump, orphan_params, stop_if_nonfinite, jump_factor)
from ._common import PullBack

NAME = "adversarial_fgsm"
DESCRIPTION = "fast FGSM adversarial training: random-start delta, a backward for the input, zero_grad, the real backward"
FAULTS = {
    "nan": "log(0) inside the second linear layer `2` from onset",
    "lr1000": "SGD lr x1000 from onset",
    "lr_start": "SGD lr x1000 from step 0",
    "no_zero": "both zero_grad() calls dropped from onset",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between the real backward and step from onset",
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||0.weight||^2 in the loss, beta annealed below zero",
    "frozen_majority": "every parameter but the last (the output bias) frozen; SGD over all",
    "not_landing": "the model's parameters replaced by copies after SGD was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "crash_lr": "SGD lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
    "sorted_data": SORTED_DATA,
}
EPS, ALPHA = 0.1, 0.125


def perturb(model: nn.Module, x: torch.Tensor, y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One fast-FGSM step from a random start; its backward pass also fills the parameters' .grad."""
    delta = (torch.rand(x.shape, generator=gen) * 2 - 1) * EPS
    delta.requires_grad = True
    loss = F.cross_entropy(model((x + delta).clamp(0, 1)), y)
    loss.backward()
    delta = (delta + ALPHA * delta.grad.detach().sign()).clamp(-EPS, EPS)
    return ((x + delta).clamp(0, 1)).detach()


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 10))
    model[2] = NanGate(model[2])
    freeze_all_but_last(model, fault)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * (1000 if fault == "lr_start" else 1), momentum=0.9,
                                weight_decay=5e-4)
    orphan_params(model, fault)
    runaway, evaluated = Runaway(fault, onset, model[0].weight), StaleEval(model, fault, onset)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:128], ytr[:128]
    loader = batches(xtr, ytr, 64, gen, sort=fault == "sorted_data")
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault))
            model[2].arm(active(fault, "nan", step, onset))
            xb, yb = next(loader)
            if fault == "shuffled_labels":
                yb = shuffle(yb, gen)
            zero = not active(fault, "no_zero", step, onset)
            if zero:
                optimizer.zero_grad()
            x_adv = perturb(model, xb, yb, gen)
            if zero:
                optimizer.zero_grad()
            out_ = model(x_adv)
            loss = runaway(F.cross_entropy(out_, yb), step)
            stop_if_nonfinite(fault, loss)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=out_, batch=(x_adv, yb))
            if step % 20 == 19:
                net = evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    logits = net(xva)
                acc = float((logits.argmax(1) == yva).float().mean())
                diag.log_eval(loss=F.cross_entropy(logits, yva).item(), accuracy=acc)
                model.train()
                accs.append(acc)
    progress = Progress("val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.05)
    return StyleRun(diag, fault_onset(fault, onset), steps, "2", fault, progress, crash["error"], timer.seconds)

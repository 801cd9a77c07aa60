"""Model-agnostic meta-learning the way dragen1860/MAML-Pytorch and learn2learn-free tutorials write it:
each meta-step samples 4 five-way tasks from the digits (5 support and 5 query images per class), adapts
the weights in an inner loop of 2 steps with ``torch.autograd.grad(..., create_graph=True)`` and
``torch.func.functional_call`` on the adapted parameters (inner lr 0.4), and backpropagates the query
loss **through the inner steps** (second order) into the meta-parameters; Adam 1e-3 meta-optimizer.

Mechanisms: the model called through ``functional_call`` with parameters that are not its own (the
adapted ones), gradients taken by ``autograd.grad`` that never reach ``.grad`` (the inner loop), a
backward pass through a graph of gradients (``create_graph``), a loss averaged over tasks, labels
re-drawn per task (class ids 0-4 mean a different digit each time).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, wipe_grads, jump_factor, lr_jump, stop_if_nonfinite)

NAME = "maml_second_order"
DESCRIPTION = "MAML-Pytorch style: inner autograd.grad(create_graph=True) steps via functional_call, second-order meta-Adam"
FAULTS = {
    "nan": "log(0) inside the second linear layer `2` from onset",
    "lr1000": "the meta-optimizer's lr x1000 from onset",
    "crash_lr": "the meta-optimizer's lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "the meta-optimizer's lr x1000 from step 0",
    "no_zero": "meta_opt.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between the meta backward and step from onset",
}
WAYS, SHOTS, TASKS, INNER_STEPS, INNER_LR = 5, 5, 4, 2, 0.4


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, _, _ = digits()
    by_class = [xtr[ytr == c] for c in range(10)]
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, WAYS))
    model[2] = NanGate(model[2])
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))

    def task() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        classes = torch.randperm(10, generator=gen)[:WAYS].tolist()
        support, query = [], []
        for c in classes:
            idx = torch.randperm(len(by_class[c]), generator=gen)[:2 * SHOTS]
            support.append(by_class[c][idx[:SHOTS]])
            query.append(by_class[c][idx[SHOTS:]])
        labels = torch.arange(WAYS).repeat_interleave(SHOTS)
        return torch.cat(support), labels, torch.cat(query), labels

    accs: list[float] = []
    diag = session(model, meta_opt, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(meta_opt, jump_factor(fault))
            model[2].arm(active(fault, "nan", step, onset))
            if not active(fault, "no_zero", step, onset):
                meta_opt.zero_grad()
            meta_loss: Any = 0.0
            acc = 0.0
            for _ in range(TASKS):
                xs, ys, xq, yq = task()
                params = dict(model.named_parameters())
                for _ in range(INNER_STEPS):
                    inner = F.cross_entropy(functional_call(model, params, (xs,)), ys)
                    grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
                    params = {k: v - INNER_LR * g for (k, v), g in zip(params.items(), grads)}
                logits = functional_call(model, params, (xq,))
                meta_loss = meta_loss + F.cross_entropy(logits, yq) / TASKS
                acc += float((logits.argmax(1) == yq).float().mean()) / TASKS
            stop_if_nonfinite(fault, meta_loss)
            meta_loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            meta_opt.step()
            diag.step(meta_loss, outputs=logits, batch=(xq, yq))
            accs.append(acc)
    progress = Progress("query accuracy after adaptation", sum(accs[:20]) / 20, sum(accs[-20:]) / 20,
                        higher_is_better=True, min_gain=0.15) if len(accs) >= 40 else None
    return StyleRun(diag, fault_onset(fault, onset), steps, "2", fault, progress, crash["error"], timer.seconds)

"""Class-incremental continual learning with a small replay buffer, as split-MNIST tutorials and
Avalanche's naive/replay strategies run it: the digits split into tasks of two classes, trained one
task after the other (100 steps each) with one shared 10-way head, Adam; from the second task on each
batch is the current task's data plus 16 samples replayed from a buffer of earlier tasks; evaluation
every 50 steps on every class seen so far (the evaluation set grows at each task switch).

Mechanisms: at each task switch the first batch of unseen classes has a loss and a gradient 20-100x
their level at once, and both stay high for tens of steps while the model learns the new classes
(what an explosion looks like, without anything before it: the learning rate is constant); the
validation loss of the grown evaluation set rises above the train loss while the train loss rose too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, shuffle, wipe_grads, Runaway, freeze_all_but_last,
                      lr_jump, orphan_params)
from ._common import PullBack

NAME = "continual_replay"
DESCRIPTION = "split-digits class-incremental learning with a replay buffer (Avalanche-style): tasks switch every 100 steps"
FAULTS = {
    "nan": "log(0) inside the hidden layer `0` from onset",
    "lr1000": "lr x1000 from onset",
    "lr_start": "lr x1000 from step 0",
    "no_zero": "zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "eval_mode": "model.eval() left on (Dropout off)",
    "shuffled_labels": "targets shuffled within each batch",
    "runaway": "from onset - beta * ||3.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the hidden layer `0` detached: it never gets a gradient, the head trains",
    "frozen_majority": "every parameter but the last (the head's bias) frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
}
TASK_STEPS = 100
REPLAY = 16


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(NanGate(nn.Linear(64, 128)), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    model[0].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, model[3].weight)
    memory_x: list[torch.Tensor] = []
    memory_y: list[torch.Tensor] = []
    accs: list[float] = []
    loader = None
    pull = PullBack(fault, onset, model)
    diag = session(model, opt, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        if fault == "eval_mode":
            model.eval()
        for step in range(steps):
            task = step // TASK_STEPS
            if step % TASK_STEPS == 0:  # a new task: its two classes; the last one's samples join the buffer
                if task:
                    kept = torch.nonzero((ytr == 2 * task - 2) | (ytr == 2 * task - 1)).flatten()[:40]
                    memory_x += list(xtr[kept])
                    memory_y += list(ytr[kept])
                mine = (ytr == 2 * task) | (ytr == 2 * task + 1)
                loader = batches(xtr[mine], ytr[mine], 32, gen)
            if lr_jump(fault, step, onset):
                bump_lr(opt, 1000.0)
            model[0].arm(active(fault, "nan", step, onset))
            if fault != "eval_mode":
                model.train()
            x, y = next(loader)
            if memory_x:
                idx = torch.randint(len(memory_x), (REPLAY,), generator=gen)
                x = torch.cat([x, torch.stack([memory_x[i] for i in idx])])
                y = torch.cat([y, torch.stack([memory_y[i] for i in idx])])
            if fault == "shuffled_labels":
                y = shuffle(y, gen)
            logits = model(x)
            loss = runaway(F.cross_entropy(logits, y), step)
            if not active(fault, "no_zero", step, onset):
                opt.zero_grad()
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            opt.step()
            pull(step)
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 50 == 49:
                seen = yva < 2 * task + 2
                model.eval()
                with torch.no_grad():
                    out_ = model(xva[seen])
                    acc = float((out_.argmax(1) == yva[seen]).float().mean())
                    diag.log_eval(loss=F.cross_entropy(out_, yva[seen]).item(), accuracy=acc)
                accs.append(acc)
    # learned: every class seen so far is recognised at the end well above chance for them (1 / classes)
    classes = 2 * ((steps - 1) // TASK_STEPS + 1)
    progress = Progress(f"val accuracy on the {classes} classes seen", 1.0 / classes, accs[-1] if accs else 0.0,
                        higher_is_better=True, min_gain=0.4)
    return StyleRun(diag, fault_onset(fault, onset), steps, "0", fault, progress, crash["error"], timer.seconds)

"""Knowledge distillation in the style of PyTorch's "Knowledge Distillation Tutorial": a frozen,
pretrained teacher (a wider MLP, ``teacher.eval()``, logits under ``no_grad``) and a small student
trained on ``0.25 * KL(teacher_T || student_T) * T^2 + 0.75 * CE(student, labels)`` with temperature
T = 2 (the KL written as ``sum(soft_targets * (soft_targets.log() - soft_prob)) / batch``), Adam at
1e-3, validation every 20 steps. Only the student is in the session; the teacher's forwards run
beside it every step.

Mechanisms: a loss with a floor well above zero (the KL to a teacher the student cannot match),
a second network's forwards outside the optimizer, soft targets inside the loss while the batch
carries hard labels.
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
                      Runaway, StaleEval, freeze_all_but_last, lr_jump, orphan_params, DUP_WORKERS)
from ._common import PullBack

NAME = "distillation"
DESCRIPTION = "PyTorch knowledge-distillation tutorial: frozen teacher, KL(T=2)*T^2 + CE, student Adam 1e-3"
FAULTS = {
    "nan": "log(0) inside the student's second layer `layers.3` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "student.eval() left on (Dropout off)",
    "shuffled_labels": "labels shuffled within each batch (the teacher's targets stay right)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||layers.0.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of `layers.3` detached: layers.0 and layers.3 never get a gradient",
    "frozen_majority": "every student parameter but the last (the head's bias) frozen; Adam over all",
    "not_landing": "the student's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the student made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the student toward a copy taken at onset after each step",
    "sorted_data": SORTED_DATA,
}
T, SOFT_WEIGHT, CE_WEIGHT = 2.0, 0.25, 0.75


class Net(nn.Module):
    def __init__(self, hidden: int, dropout: float) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, hidden),
                                    nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@functools.lru_cache(maxsize=None)
def teacher_state(seed: int) -> dict[str, torch.Tensor]:
    """The teacher "checkpoint": a 256-wide MLP trained 200 Adam steps on digits."""
    xtr, ytr, _, _ = digits()
    torch.manual_seed(2000 + seed)
    net = Net(256, 0.1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    loader = batches(xtr, ytr, 64, torch.Generator().manual_seed(2000 + seed))
    for _ in range(200):
        x, y = next(loader)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    with one_thread():
        state = teacher_state(seed)
    teacher = Net(256, 0.1)
    teacher.load_state_dict(state)
    teacher.eval()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    student = Net(32, 0.1)
    student.layers[3] = NanGate(student.layers[3])
    student.layers[3].cut = fault == "detached"
    freeze_all_but_last(student, fault)
    ce_loss = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(student, fault)
    runaway, evaluated = Runaway(fault, onset, student.layers[0].weight), StaleEval(student, fault, onset)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    loader = batches(xtr, ytr, 32, gen, sort=fault == "sorted_data")
    loader = restart_loader(loader, fault, onset)
    accs: list[float] = []
    pull = PullBack(fault, onset, student)
    diag = session(student, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        student.train()
        if fault == "eval_mode":
            student.eval()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, 1000.0)
            student.layers[3].arm(active(fault, "nan", step, onset))
            inputs, labels = next(loader)
            if fault == "shuffled_labels":
                labels = shuffle(labels, gen)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            with torch.no_grad():
                teacher_logits = teacher(inputs)
            student_logits = student(inputs)
            soft_targets = F.softmax(teacher_logits / T, dim=-1)
            soft_prob = F.log_softmax(student_logits / T, dim=-1)
            soft_targets_loss = torch.sum(soft_targets * (soft_targets.log() - soft_prob)) / soft_prob.size()[0] * (T**2)
            label_loss = ce_loss(student_logits, labels)
            loss = runaway(SOFT_WEIGHT * soft_targets_loss + CE_WEIGHT * label_loss, step)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(student.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=student_logits, batch=(inputs, labels))
            if step % 20 == 0 or step == steps - 1:
                was_training, net = student.training, evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    logits = net(xva)
                net.train(was_training)
                acc = float((logits.argmax(1) == yva).float().mean())
                diag.log_eval(loss=ce_loss(logits, yva).item(), accuracy=acc)
                accs.append(acc)
    progress = Progress("student val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.3)
    return StyleRun(diag, fault_onset(fault, onset), steps, "layers.3", fault, progress, crash["error"],
                    timer.seconds)

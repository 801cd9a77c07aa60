"""Multi-task learning as hard-parameter-sharing tutorials write it: a shared trunk and three heads
(digit class: cross-entropy; parity: ``BCEWithLogits``; ink, the mean pixel intensity: MSE), the
model returns a **dict of outputs**, the targets are a dict, the loss is a fixed weighted sum
``ce + 0.5 * bce + 10 * mse``, Adam at 1e-3, per-task validation every 20 steps. trackdiag gets
``outputs=out`` (the dict) and ``batch=(x, targets)``.

Mechanisms: dict outputs and dict targets, a loss that is a sum of terms of different scales
(unweighted, the regression term is ~100x smaller than the others), heads that
learn at different speeds.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, wipe_grads, SAME_BATCH, restart_loader, Runaway,
                      StaleEval, freeze_all_but_last, lr_jump, orphan_params, DUP_WORKERS)
from ._common import PullBack

NAME = "multitask"
DESCRIPTION = "hard-parameter-sharing tutorials: shared trunk, 3 heads (CE, BCE, MSE), dict outputs, weighted sum"
FAULTS = {
    "nan": "log(0) inside the trunk's second layer `trunk.3` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (Dropout off)",
    "shuffled_labels": "every task's targets shuffled (together) within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||trunk.0.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `trunk.3` detached: the trunk never gets a gradient, the heads train",
    "frozen_majority": "every parameter but the last frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the trunk and heads toward a copy taken at onset after each step",
}
WEIGHTS = {"digit": 1.0, "parity": 0.5, "ink": 10.0}


class MultiTaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 64), nn.ReLU())
        self.heads = nn.ModuleDict({"digit": nn.Linear(64, 10), "parity": nn.Linear(64, 1), "ink": nn.Linear(64, 1)})

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"digit": self.heads["digit"](h), "parity": self.heads["parity"](h).squeeze(-1),
                "ink": self.heads["ink"](h).squeeze(-1)}


def make_targets(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"digit": y, "parity": (y % 2).float(), "ink": x.mean(dim=1)}


def losses(out: dict[str, torch.Tensor], t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"digit": F.cross_entropy(out["digit"], t["digit"]),
            "parity": F.binary_cross_entropy_with_logits(out["parity"], t["parity"]),
            "ink": F.mse_loss(out["ink"], t["ink"])}


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = MultiTaskNet()
    model.trunk[3] = NanGate(model.trunk[3])
    model.trunk[3].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway, evaluated = Runaway(fault, onset, model.trunk[0].weight), StaleEval(model, fault, onset)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    loader = batches(xtr, ytr, 32, gen)
    loader = restart_loader(loader, fault, onset)
    val_targets = make_targets(xva, yva)
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        if fault == "eval_mode":
            model.eval()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, 1000.0)
            model.trunk[3].arm(active(fault, "nan", step, onset))
            x, y = next(loader)
            targets = make_targets(x, y)
            if fault == "shuffled_labels":
                perm = torch.randperm(len(y), generator=gen)
                targets = {k: v[perm] for k, v in targets.items()}
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            outputs = model(x)
            parts = losses(outputs, targets)
            loss = runaway(sum(WEIGHTS[k] * v for k, v in parts.items()), step)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=outputs, batch=(x, targets))
            if step % 20 == 0 or step == steps - 1:
                was_training, net = model.training, evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    vo = net(xva)
                    vparts = losses(vo, val_targets)
                net.train(was_training)
                acc = float((vo["digit"].argmax(1) == yva).float().mean())
                diag.log_eval(loss=float(sum(WEIGHTS[k] * v for k, v in vparts.items())), digit_accuracy=acc,
                              **{f"{k}_loss": float(v) for k, v in vparts.items()})
                accs.append(acc)
    progress = Progress("val digit accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.4)
    return StyleRun(diag, fault_onset(fault, onset), steps, "trunk.3", fault, progress, crash["error"], timer.seconds)

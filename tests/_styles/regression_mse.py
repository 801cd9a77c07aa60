"""Tabular regression as beginners' tutorials write it: scikit-learn's diabetes table, features
standardised but the **target left in its units** (disease progression, 25-346), an
``nn.Sequential`` MLP with Dropout returning one number per row, ``nn.MSELoss()``, Adam at 1e-2,
mini-batches of 32, validation MSE and R^2 every 20 steps.

Mechanisms: loss scale (the MSE starts near 29,000 and ends near 3,000: large and far from any
"chance level"), an output of width 1 that is not a class logit, float targets, a noisy
mini-batch loss on a small table, layers named by bare indices (``0``, ``2``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      fault_onset, one_thread, session, shuffle, sk_table, wipe_grads, SAME_BATCH, restart_loader,
                      Runaway, StaleEval, freeze_all_but_last, lr_jump, orphan_params, DUP_WORKERS)
from ._common import PullBack

NAME = "regression_mse"
DESCRIPTION = "tutorial tabular regression: diabetes, raw-unit targets, Sequential MLP, MSELoss, Adam 1e-2"
FAULTS = {
    "nan": "log(0) inside the second linear layer `2` of the Sequential from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (Dropout off)",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||0.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `2` detached: layers 0 and 2 never get a gradient",
    "frozen_majority": "every parameter but the last (the output bias) frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
}


def r2(pred: torch.Tensor, y: torch.Tensor) -> float:
    return float(1 - ((pred - y) ** 2).sum() / ((y - y.mean()) ** 2).sum())


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = sk_table("diabetes")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    model[2] = NanGate(model[2])
    model[2].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    criterion = nn.MSELoss()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway, evaluated = Runaway(fault, onset, model[0].weight), StaleEval(model, fault, onset)
    if fault == "tiny_subset":
        xtr, ytr = xtr[:64], ytr[:64]
    loader = batches(xtr, ytr, 32, gen)
    loader = restart_loader(loader, fault, onset)
    scores: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        if fault == "eval_mode":
            model.eval()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, 1000.0)
            model[2].arm(active(fault, "nan", step, onset))
            xb, yb = next(loader)
            if fault == "shuffled_labels":
                yb = shuffle(yb, gen)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            pred = model(xb)
            loss = runaway(criterion(pred, yb.unsqueeze(1)), step)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=pred, batch=(xb, yb))
            if step % 20 == 19:
                was_training, net = model.training, evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    p = net(xva).squeeze(1)
                net.train(was_training)
                score = r2(p, yva)
                diag.log_eval(loss=criterion(p, yva).item(), r2=score)
                scores.append(score)
    progress = Progress("val R^2", scores[0], scores[-1], higher_is_better=True, min_gain=0.3)
    return StyleRun(diag, fault_onset(fault, onset), steps, "2", fault, progress, crash["error"], timer.seconds)

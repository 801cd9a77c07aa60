"""A Switch-Transformer-style mixture of experts (Fedus et al. 2021; the ``switch``/``st-moe``
tutorials): a router picks **one expert per sample**, only the chosen experts run (a loop over
``idx.unique()``), their output is scaled by the router probability, and a load-balancing loss
(fraction routed x mean router probability, times the number of experts) is added at 0.01.
Eight experts in an ``nn.ModuleList``, Adam at 1e-3, batches of 32, validation every 20 steps.

Mechanisms: experts no sample chose get **no gradient** that step (and Adam's state for them goes
stale), a ``ModuleList`` whose entries run or not depending on the batch, a second loss term.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import SORTED_DATA
from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, shuffle, wipe_grads, SAME_BATCH, restart_loader, Runaway,
                      StaleEval, freeze_all_but_last, lr_jump, orphan_params, DUP_WORKERS)
from ._common import PullBack

NAME = "moe_top1"
DESCRIPTION = "Switch-style mixture of experts: top-1 routing, only chosen experts run, load-balancing loss, Adam"
FAULTS = {
    "nan": "log(0) inside the input projection `inp` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "runaway": "from onset - beta * ||the first expert's weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `inp` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
    "sorted_data": SORTED_DATA,
}


class SwitchMoE(nn.Module):
    def __init__(self, n_experts: int = 8, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.router = nn.Linear(width, n_experts)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width))
                                      for _ in range(n_experts)])
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.relu(self.inp(x))
        probs = self.router(h).softmax(-1)
        gate, idx = probs.max(-1)
        mixed = torch.zeros_like(h)
        for e in idx.unique().tolist():  # only the experts some sample was routed to run
            sel = idx == e
            mixed[sel] = gate[sel, None] * self.experts[e](h[sel])
        n = len(self.experts)
        balance = n * (F.one_hot(idx, n).float().mean(0) * probs.mean(0)).sum()
        return self.head(h + mixed), balance


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = SwitchMoE()
    model.inp = NanGate(model.inp)
    model.inp.cut = fault == "detached"
    freeze_all_but_last(model, fault)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, next(p for n, p in model.named_parameters() if "experts" in n and p.dim() >= 2))
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
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, 1000.0)
            model.inp.arm(active(fault, "nan", step, onset))
            xb, yb = next(loader)
            if fault == "shuffled_labels":
                yb = shuffle(yb, gen)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            logits, balance = model(xb)
            loss = runaway(F.cross_entropy(logits, yb) + 0.01 * balance, step)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, outputs=logits, batch=(xb, yb))
            if step % 20 == 19:
                net = evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    val_logits, _ = net(xva)
                acc = float((val_logits.argmax(1) == yva).float().mean())
                diag.log_eval(loss=F.cross_entropy(val_logits, yva).item(), accuracy=acc)
                model.train()
                accs.append(acc)
    progress = Progress("val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.1)
    return StyleRun(diag, fault_onset(fault, onset), steps, "inp", fault, progress, crash["error"], timer.seconds)

"""The nanoGPT ``train.py`` loop shape around a small residual MLP classifier: bf16 autocast
(``torch.autocast(device_type, dtype=torch.bfloat16)``, no GradScaler needed for bf16), gradient
accumulation over 2 micro-batches (``loss / grad_accum`` inside autocast), clipping at 1.0, AdamW
with decay/no-decay groups, a linear warm-up then cosine decay to a tenth written by hand each
iteration, ``zero_grad(set_to_none=True)``, evaluation every 20 iterations (``estimate_loss``).
trackdiag gets the accumulated loss and the last micro-batch's bf16 logits.

Mechanisms: bf16 outputs and activations, accumulation, clipping (pre-clip norms), a schedule that
starts near zero, LayerNorm/residual blocks.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, shuffle, wipe_grads, SAME_BATCH, restart_loader, Runaway,
                      StaleEval, freeze_all_but_last, orphan_params)
from ._common import PullBack

NAME = "amp_bf16"
DESCRIPTION = "nanoGPT train.py loop: bf16 autocast, 2-step accumulation, clip 1.0, AdamW groups, warm-up+cosine"
FAULTS = {
    "nan": "log(0) inside the second residual block `blocks.1` from onset",
    "lr1000": "the hand-written schedule's learning rate x1000 from onset",
    "lr_start": "the learning rate x1000 from step 0",
    "no_zero": "optimizer.zero_grad(set_to_none=True) dropped from onset",
    "shuffled_labels": "targets shuffled within each micro-batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) instead of 1.0 from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "tiny_subset": "trains on two micro-batches; evaluation every 20 iterations",
    "runaway": "from onset - beta * ||blocks.0 weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `blocks.1` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; AdamW over all",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
}
GRAD_ACCUM, MICRO_BATCH, LR, WARMUP = 2, 16, 3e-3, 20


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class ResMLP(nn.Module):
    def __init__(self, d: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln_f(h))


def get_lr(it: int, max_iters: int) -> float:
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    ratio = (it - WARMUP) / max(1, max_iters - WARMUP)
    return 0.1 * LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * 0.9 * LR


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ResMLP()
    model.blocks[1] = NanGate(model.blocks[1])
    model.blocks[1].cut = fault == "detached"
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95))
    freeze_all_but_last(model, fault)  # after the optimizer was built over every parameter
    orphan_params(model, fault)
    weight = next(p for n, p in model.named_parameters() if n.startswith("blocks.0") and p.dim() >= 2)
    runaway, evaluated = Runaway(fault, onset, weight), StaleEval(model, fault, onset)
    ctx = torch.autocast(device_type="cpu", dtype=torch.bfloat16)
    if fault == "tiny_subset":
        xtr, ytr = xtr[: 2 * MICRO_BATCH], ytr[: 2 * MICRO_BATCH]
    loader = batches(xtr, ytr, MICRO_BATCH, gen)
    loader = restart_loader(loader, fault, onset, per_step=GRAD_ACCUM)
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for it in range(steps):
            lr = get_lr(it, steps) * (1000 if fault == "lr_start" or (fault == "lr1000" and it >= onset) else 1)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            model.blocks[1].arm(active(fault, "nan", it, onset))
            total = torch.zeros(())
            for _ in range(GRAD_ACCUM):
                X, Y = next(loader)
                if fault == "shuffled_labels":
                    Y = shuffle(Y, gen)
                with ctx:
                    logits = model(X)
                    loss = runaway(F.cross_entropy(logits, Y) / GRAD_ACCUM, it)
                total += loss.detach()
                loss.backward()
            if active(fault, "wiped_grads", it, onset):
                wipe_grads(model.parameters())
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            pull(it)
            if not active(fault, "no_zero", it, onset):
                optimizer.zero_grad(set_to_none=True)
            diag.step(total, outputs=logits, batch=(X, Y))
            if it % 20 == 19:
                net = evaluated.at(it)
                net.eval()
                with torch.no_grad(), ctx:
                    val = net(xva)
                    vloss = F.cross_entropy(val, yva).item()
                model.train()
                acc = float((val.argmax(1) == yva).float().mean())
                diag.log_eval(loss=vloss, accuracy=acc)
                accs.append(acc)
    progress = Progress("val accuracy", 0.1, accs[-1] if accs else 0.0, higher_is_better=True, min_gain=0.5)
    return StyleRun(diag, fault_onset(fault, onset), steps, "blocks.1", fault, progress, crash["error"], timer.seconds)

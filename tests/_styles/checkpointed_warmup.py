"""A pre-norm transformer trained the way Hugging Face scripts run large models, small: every block
under ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` (what
``model.gradient_checkpointing_enable()`` does), so each block's forward runs a second time inside
``backward()``; AdamW (weight decay 0.01 on matrices only, two parameter groups) with the
``get_linear_schedule_with_warmup``-style ``LambdaLR`` that starts at learning rate **0**, and
``clip_grad_norm_(1.0)``. The digits' 8 rows are the tokens; classification from the mean token.

Mechanisms: forward passes replayed during backward (module calls seen twice per step, the second
time inside the backward pass), a first optimizer step with learning rate 0 (no update at all),
attention with dropout, LayerNorm, two parameter groups with different weight decay.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ._common import SORTED_DATA
from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, SAME_BATCH, restart_loader, Runaway,
                      freeze_all_but_last, lr_jump, orphan_params, jump_factor, stop_if_nonfinite, DUP_WORKERS)
from ._common import PullBack

NAME = "checkpointed_warmup"
DESCRIPTION = "HF-style: blocks under torch.utils.checkpoint (forward replayed in backward), warmup from lr 0, clip 1.0"
FAULTS = {
    "nan": "log(0) inside block 1's second MLP linear `blocks.1.mlp.2` from onset",
    "lr1000": "AdamW lr (and the schedule's base lrs) x1000 from onset",
    "crash_lr": "AdamW lr (and the schedule's base lrs) x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "AdamW lr (and the schedule's base lrs) x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (dropout off, no checkpointing: the model checkpoints in training mode only)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) instead of 1.0 from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "runaway": "from onset - beta * ||blocks.0 weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `blocks.1.mlp.2` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; AdamW over all",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
    "sorted_data": SORTED_DATA,
}
WARMUP = 30


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.zeros(1, 8, d))
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, 10)
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(-1, 8, 8)) + self.pos
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.gradient_checkpointing and self.training else block(h)
        return self.head(self.ln_f(h).mean(1))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = Net()
    model.blocks[1].mlp[2] = NanGate(model.blocks[1].mlp[2])
    model.blocks[1].mlp[2].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=3e-3)
    total = steps
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, next(p for n, p in model.named_parameters() if n.startswith("blocks.0") and p.dim() >= 2))

    def lr_lambda(step: int) -> float:  # transformers.get_linear_schedule_with_warmup
        if step < WARMUP:
            return step / max(1, WARMUP)
        return max(0.0, (total - step) / max(1, total - WARMUP))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if fault == "lr_start":
        bump_lr(optimizer, 1000.0, scheduler)
    loader = batches(xtr, ytr, 32, gen, sort=fault == "sorted_data")
    loader = restart_loader(loader, fault, onset)
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for step in range(steps):
            model.train()
            if fault == "eval_mode":
                model.eval()
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault), scheduler)
            model.blocks[1].mlp[2].arm(active(fault, "nan", step, onset))
            x, y = next(loader)
            logits = model(x)
            loss = runaway(F.cross_entropy(logits, y), step)
            stop_if_nonfinite(fault, loss)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.0 if active(fault, "wiped_grads", step, onset) else 1.0)
            optimizer.step()
            pull(step)
            scheduler.step()
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 50 == 0 or step == steps - 1:
                model.eval()
                with torch.no_grad():
                    val = model(xva)
                accs.append(float((val.argmax(1) == yva).float().mean()))
                diag.log_eval(loss=float(F.cross_entropy(val, yva)), accuracy=accs[-1])
    progress = Progress("val accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.2) if len(accs) > 1 else None
    return StyleRun(diag, fault_onset(fault, onset), steps, "blocks.1.mlp.2", fault, progress, crash["error"], timer.seconds)

"""Causal language modelling in the style of Hugging Face's ``run_clm_no_trainer.py``: a
``GPT2LMHeadModel`` built from a tiny ``GPT2Config`` (no download), the corpus grouped into
32-character blocks whose ``labels`` are a copy of ``input_ids`` (the model shifts them internally),
``outputs = model(**batch)`` and ``outputs.loss``, AdamW with the script's no-decay groups
(``["bias", "layer_norm.weight"]``: GPT-2's norms are ``ln_1``/``ln_2``/``ln_f``, so they decay
anyway, as in the script), a linear schedule with warm-up, evaluation every 20 steps.
trackdiag gets ``outputs=outputs.logits`` and the batch dict.

Mechanisms: the model computes its own loss (shifted labels equal to the inputs by design), a
transformers model's module tree, a warm-up/decay schedule.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import torch

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, session, wipe_grads, SAME_BATCH, restart_loader, Runaway, StaleEval,
                      freeze_all_but_last, orphan_params, jump_factor, lr_jump, stop_if_nonfinite, DUP_WORKERS)
from ._common import PullBack

NAME = "hf_causal_lm"
DESCRIPTION = "transformers run_clm_no_trainer.py: tiny GPT2LMHeadModel, model(**batch).loss with labels=input_ids"
FAULTS = {
    "nan": "log(0) inside the second block's attention `transformer.h.1.attn` from onset",
    "lr1000": "AdamW lr (and the scheduler's base lr) x1000 from onset",
    "crash_lr": "AdamW lr (and the scheduler's base lr) x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "AdamW lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "trains on two fixed batches; evaluation every 20 steps",
    "runaway": "from onset - beta * ||h.0.mlp.c_fc.weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of block 1's attention `transformer.h.1.attn` detached: it and ln_1 never get a gradient",
    "frozen_majority": "every parameter but the last (the final LayerNorm's bias) frozen; AdamW over all",
    "not_landing": "the model's parameters replaced by copies after AdamW was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the model toward a copy taken at onset after each step",
}
BLOCK, BSZ = 32, 4


def group_texts(ids: torch.Tensor) -> torch.Tensor:
    """run_clm's group_texts: concatenated text cut into blocks of BLOCK tokens (the remainder dropped)."""
    n = len(ids) // BLOCK
    return ids[: n * BLOCK].view(n, BLOCK)


def dataloader(blocks: torch.Tensor, gen: torch.Generator) -> Iterator[dict[str, torch.Tensor]]:
    """DataLoader(shuffle=True, collate_fn=default_data_collator, batch_size=BSZ) over the blocks."""
    while True:
        perm = torch.randperm(len(blocks), generator=gen)
        for i in range(0, len(perm) - BSZ + 1, BSZ):
            ids = blocks[perm[i : i + BSZ]]
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

    from _loops import char_data

    check_fault(fault, FAULTS)
    transformers.logging.set_verbosity_error()
    timer = Timer()
    data, vocab = char_data()
    split = int(0.95 * len(data))
    blocks, val_blocks = group_texts(data[:split]), group_texts(data[split:])
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.transformer.h[1].attn = NanGate(model.transformer.h[1].attn)
    model.transformer.h[1].attn.cut = fault == "detached"
    freeze_all_but_last(model, fault)
    no_decay = ["bias", "layer_norm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=2e-3 * (1000 if fault == "lr_start" else 1))
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=max(1, steps // 20),
                                 num_training_steps=steps)
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, model.transformer.h[0].mlp.c_fc.weight)
    evaluated = StaleEval(model, fault, onset)
    loader = dataloader(blocks, gen)
    fixed = [next(loader) for _ in range(2)]
    loader = restart_loader(loader, fault, onset)
    eval_batch = {"input_ids": val_blocks[:32], "labels": val_blocks[:32]}
    losses: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault), lr_scheduler)
            model.transformer.h[1].attn.arm(active(fault, "nan", step, onset))
            batch = fixed[step % 2] if fault == "tiny_subset" else next(loader)
            outputs = model(**batch)
            loss = runaway(outputs.loss, step)
            stop_if_nonfinite(fault, loss)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            lr_scheduler.step()
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            losses.append(loss.item())
            diag.step(loss, outputs=outputs.logits, batch=batch)
            if step % 20 == 19:
                net = evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    diag.log_eval(loss=net(**eval_batch).loss.item())
                model.train()
    progress = Progress("train loss", mean(losses[:10]), mean(losses[-10:]), min_gain=0.5)
    return StyleRun(diag, fault_onset(fault, onset), steps, "transformer.h.1.attn", fault, progress, crash["error"],
                    timer.seconds)

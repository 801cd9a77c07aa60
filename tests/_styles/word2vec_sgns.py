"""Skip-gram with negative sampling in the style of the popular ``word2vec-pytorch`` implementations
(e.g. Andras7's ``SkipGramModel``): two ``nn.Embedding(sparse=True)`` tables, the context table
initialised to **zero**, a forward that **returns the loss** (clamped scores, ``-logsigmoid`` of the
positive pair plus the summed ``-logsigmoid(-score)`` of 5 negatives drawn from the unigram^0.75
distribution), ``SparseAdam`` with a cosine schedule stepped before each batch. Pairs come from a
window of 2 around each word of the frozen corpus. trackdiag gets ``diag.step(loss,
batch=(pos_u, pos_v, neg_v))``.

Mechanisms: every parameter has sparse gradients; at step 0 the centre table's gradient is exactly
zero (the context table is all zeros); the loss starts at exactly 6 ln 2 = 4.16 and has a floor far
above 0; integer index tensors as the batch and no outputs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, session, wipe_grads, SAME_BATCH, restart_loader, DUP_WORKERS)
from ._common import PullBack

NAME = "word2vec_sgns"
DESCRIPTION = "word2vec-pytorch SkipGramModel: two sparse embeddings (context at 0), forward returns the loss, SparseAdam"
FAULTS = {
    "nan": "log(0) inside the context table `v_embeddings` from onset",
    "lr1000": "SparseAdam lr (and the schedule's base) x1000 from onset",
    "lr_start": "SparseAdam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "wiped_grads": "sparse gradients scaled to 0 between backward and step from onset",
    "same_batch": SAME_BATCH,
    "dup_workers": DUP_WORKERS,
    "reversed_ema": "from onset a reversed EMA update pulls the embeddings toward a copy taken at onset after each step",
}
VOCAB, DIM, WINDOW, NEG, BSZ = 2000, 32, 2, 5, 64


class SkipGramModel(nn.Module):
    def __init__(self, emb_size: int, emb_dimension: int) -> None:
        super().__init__()
        self.u_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        self.v_embeddings = nn.Embedding(emb_size, emb_dimension, sparse=True)
        initrange = 1.0 / emb_dimension
        nn.init.uniform_(self.u_embeddings.weight.data, -initrange, initrange)
        nn.init.constant_(self.v_embeddings.weight.data, 0)

    def forward(self, pos_u: torch.Tensor, pos_v: torch.Tensor, neg_v: torch.Tensor) -> torch.Tensor:
        emb_u = self.u_embeddings(pos_u)
        emb_v = self.v_embeddings(pos_v)
        emb_neg_v = self.v_embeddings(neg_v)
        score = torch.clamp(torch.sum(torch.mul(emb_u, emb_v), dim=1), max=10, min=-10)
        score = -F.logsigmoid(score)
        neg_score = torch.clamp(torch.bmm(emb_neg_v, emb_u.unsqueeze(2)).squeeze(2), max=10, min=-10)
        neg_score = -torch.sum(F.logsigmoid(-neg_score), dim=1)
        return torch.mean(score + neg_score)


def pair_batches(data: torch.Tensor, ntok: int, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, ...]]:
    counts = torch.bincount(data, minlength=ntok).float()
    noise = counts.pow(0.75)
    noise /= noise.sum()
    while True:
        centre = torch.randint(WINDOW, len(data) - WINDOW, (BSZ,), generator=gen)
        offset = torch.randint(1, WINDOW + 1, (BSZ,), generator=gen) * (torch.randint(0, 2, (BSZ,), generator=gen) * 2 - 1)
        neg = torch.multinomial(noise, BSZ * NEG, replacement=True, generator=gen).view(BSZ, NEG)
        yield data[centre], data[centre + offset], neg


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    from _loops import word_data

    check_fault(fault, FAULTS)
    timer = Timer()
    data, ntok = word_data(max_vocab=VOCAB)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = SkipGramModel(ntok, DIM)
    model.v_embeddings = NanGate(model.v_embeddings)
    optimizer = torch.optim.SparseAdam(list(model.parameters()), lr=1e-2 * (1000 if fault == "lr_start" else 1))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    loader = pair_batches(data, ntok, gen)
    loader = restart_loader(loader, fault, onset)
    losses: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for i in range(steps):
            if fault == "lr1000" and i == onset:
                bump_lr(optimizer, 1000.0, scheduler)
            model.v_embeddings.arm(active(fault, "nan", i, onset))
            pos_u, pos_v, neg_v = next(loader)
            scheduler.step()
            if not active(fault, "no_zero", i, onset):
                optimizer.zero_grad()
            loss = model(pos_u, pos_v, neg_v)
            loss.backward()
            if active(fault, "wiped_grads", i, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(i)
            losses.append(loss.item())
            diag.step(loss, batch=(pos_u, pos_v, neg_v))
    progress = Progress("SGNS loss", mean(losses[:10]), mean(losses[-20:]), min_gain=0.4)
    return StyleRun(diag, fault_onset(fault, onset), steps, "v_embeddings", fault, progress, crash["error"],
                    timer.seconds)

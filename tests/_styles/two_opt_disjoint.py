"""One model, two optimizers over disjoint halves, as large-vocabulary models are often trained: a
word-level GRU language model whose input table is ``nn.Embedding(sparse=True)`` stepped by
``SparseAdam``, while the GRU and the decoder are stepped by ``Adam`` with the dense gradients
clipped at 5 (``clip_grad_norm_`` refuses sparse gradients). trackdiag is given the single model and
a dict of the two optimizers, ``Diagnostics(model, {"sparse": ..., "dense": ...})``. Batches are
random 16-word windows of the frozen corpus (nanoGPT's ``get_batch``); validation every 20 steps.

Mechanisms: several optimizers over disjoint parameter sets of one model, sparse gradients (only
the rows of the words in the batch), a 1000-way softmax (loss starts near ln 1000 = 6.9).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, session, wipe_grads)
from ._common import PullBack

NAME = "two_opt_disjoint"
DESCRIPTION = "word LM: nn.Embedding(sparse=True)+SparseAdam and Adam for the rest, one model, dict of optimizers"
FAULTS = {
    "nan": "log(0) inside the GRU `rnn` from onset",
    "lr1000": "both learning rates x1000 from onset",
    "lr_start": "both learning rates x1000 from step 0",
    "no_zero": "both zero_grad() calls dropped from onset",
    "wiped_grads": "gradients scaled to 0 (clip max_norm=0) between backward and step from onset",
    "tiny_subset": "trains on two fixed batches; validation every 20 steps",
    "reversed_ema": "from onset a reversed EMA update pulls both optimizers' parameters toward a copy taken at onset after each step",
}
VOCAB, BLOCK, BSZ = 1000, 16, 8


class WordRNN(nn.Module):
    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(ntoken, ninp, sparse=True)
        self.rnn = nn.GRU(ninp, nhid, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.drop(self.embed(x)))
        return self.decoder(self.drop(out))


def get_batches(data: torch.Tensor, gen: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        ix = torch.randint(len(data) - BLOCK - 1, (BSZ,), generator=gen)
        yield (torch.stack([data[i : i + BLOCK] for i in ix]), torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix]))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    from _loops import word_data

    check_fault(fault, FAULTS)
    timer = Timer()
    data, ntok = word_data(max_vocab=VOCAB)
    split = int(0.9 * len(data))
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = WordRNN(ntok)
    model.rnn = NanGate(model.rnn)
    scale = 1000 if fault == "lr_start" else 1
    sparse_opt = torch.optim.SparseAdam(list(model.embed.parameters()), lr=1e-2 * scale)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("embed.")]
    dense_opt = torch.optim.Adam(dense_params, lr=3e-3 * scale)
    train = get_batches(data[:split], gen)
    fixed = [next(train) for _ in range(2)]
    xv, yv = next(get_batches(data[split:], torch.Generator().manual_seed(99)))
    losses: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, {"sparse": sparse_opt, "dense": dense_opt}, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                bump_lr(sparse_opt, 1000.0)
                bump_lr(dense_opt, 1000.0)
            model.rnn.arm(active(fault, "nan", step, onset))
            x, y = fixed[step % 2] if fault == "tiny_subset" else next(train)
            if not active(fault, "no_zero", step, onset):
                sparse_opt.zero_grad()
                dense_opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits.view(-1, ntok), y.view(-1))
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            torch.nn.utils.clip_grad_norm_(dense_params, 5.0)
            sparse_opt.step()
            dense_opt.step()
            pull(step)
            losses.append(loss.item())
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 20 == 19:
                model.eval()
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xv).view(-1, ntok), yv.view(-1)).item())
                model.train()
    progress = Progress("train loss", mean(losses[:10]), mean(losses[-10:]), min_gain=0.5)
    return StyleRun(diag, fault_onset(fault, onset), steps, "rnn", fault, progress, crash["error"], timer.seconds)

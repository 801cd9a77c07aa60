"""A click-through-rate recommender in the style of facebookresearch's ``dlrm_s_pytorch.py``: dense
features through a bottom MLP, three categorical features as multi-hot bags looked up in
``nn.EmbeddingBag(mode="sum", sparse=True)`` tables with **index and offset tensors**, a pairwise
dot-product interaction, a top MLP ending in a sigmoid, the script's default ``mse`` loss on the
0/1 click, and plain SGD (which takes sparse gradients) at lr 0.1. Synthetic clicks from a hidden
logistic model. trackdiag gets ``batch=(X, lS_o, lS_i, T)`` as the script names them.

Mechanisms: sparse gradients on most parameters, a batch that is a tuple holding lists of
index/offset tensors, a probability output of width 1 scored by MSE (a small loss, ~0.25 to ~0.17).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      one_thread, session, shuffle, wipe_grads)
from ._common import PullBack

NAME = "recommender_sparse"
DESCRIPTION = "facebookresearch/dlrm: EmbeddingBag(sparse=True) with offsets, dot interaction, MSE on clicks, SGD"
FAULTS = {
    "nan": "log(0) inside the bottom MLP's second layer `bot_l.2` from onset",
    "lr1000": "SGD lr x1000 from onset",
    "lr_start": "SGD lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "shuffled_labels": "click targets shuffled within each batch",
    "wiped_grads": "gradients scaled to 0 between backward and step from onset",
    "tiny_subset": "trains on two batches; validation every 20 steps",
    "reversed_ema": "from onset a reversed EMA update pulls the DLRM toward a copy taken at onset after each step",
}
TABLES, DENSE, DIM, BSZ = (100, 50, 200), 4, 8, 128


class ClickData:
    """Dense features, multi-hot bags (1-3 ids per table) and clicks from a hidden logistic model."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        hidden = torch.Generator().manual_seed(12345)
        self.w_dense = torch.randn(DENSE, generator=hidden)
        self.item_bias = [torch.randn(n, generator=hidden) * 1.5 for n in TABLES]

    def batch(self, n: int = BSZ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        X = torch.randn(n, DENSE, generator=self.gen)
        logit = X @ self.w_dense * 0.5
        lS_o, lS_i = [], []
        for k, size in enumerate(TABLES):
            lengths = torch.randint(1, 4, (n,), generator=self.gen)
            idx = torch.randint(size, (int(lengths.sum()),), generator=self.gen)
            offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
            bag = torch.repeat_interleave(torch.arange(n), lengths)
            logit = logit + torch.zeros(n).index_add_(0, bag, self.item_bias[k][idx]) / lengths
            lS_o.append(offsets)
            lS_i.append(idx)
        T = torch.bernoulli(torch.sigmoid(logit), generator=self.gen).view(-1, 1)
        return X, lS_o, lS_i, T


class DLRM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bot_l = nn.Sequential(nn.Linear(DENSE, 16), nn.ReLU(), nn.Linear(16, DIM), nn.ReLU())
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(n, DIM, mode="sum", sparse=True) for n in TABLES)
        for emb in self.emb_l:
            nn.init.uniform_(emb.weight, -(1 / emb.num_embeddings) ** 0.5, (1 / emb.num_embeddings) ** 0.5)
        n_feat = len(TABLES) + 1
        self.top_l = nn.Sequential(nn.Linear(DIM + n_feat * (n_feat - 1) // 2, 16), nn.ReLU(), nn.Linear(16, 1),
                                   nn.Sigmoid())

    def interact_features(self, x: torch.Tensor, ly: list[torch.Tensor]) -> torch.Tensor:
        T = torch.cat([x] + ly, dim=1).view(x.shape[0], -1, DIM)
        Z = torch.bmm(T, T.transpose(1, 2))
        li, lj = torch.tril_indices(T.shape[1], T.shape[1], offset=-1)
        return torch.cat([x, Z[:, li, lj]], dim=1)

    def forward(self, dense_x: torch.Tensor, lS_o: list[torch.Tensor], lS_i: list[torch.Tensor]) -> torch.Tensor:
        x = self.bot_l(dense_x)
        ly = [emb(i, o) for emb, i, o in zip(self.emb_l, lS_i, lS_o)]
        return self.top_l(self.interact_features(x, ly))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    torch.manual_seed(seed)
    data = ClickData(seed)
    val = ClickData(777).batch(2048)
    gen = torch.Generator().manual_seed(seed)
    dlrm = DLRM()
    dlrm.bot_l[2] = NanGate(dlrm.bot_l[2])
    loss_fn = torch.nn.MSELoss(reduction="mean")
    optimizer = torch.optim.SGD(dlrm.parameters(), lr=0.1 * (1000 if fault == "lr_start" else 1))
    fixed = [data.batch() for _ in range(2)]
    scores: list[float] = []
    pull = PullBack(fault, onset, dlrm)
    diag = session(dlrm, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for j in range(steps):
            if fault == "lr1000" and j == onset:
                bump_lr(optimizer, 1000.0)
            dlrm.bot_l[2].arm(active(fault, "nan", j, onset))
            X, lS_o, lS_i, T = fixed[j % 2] if fault == "tiny_subset" else data.batch()
            if fault == "shuffled_labels":
                T = shuffle(T, gen)
            Z = dlrm(X, lS_o, lS_i)
            E = loss_fn(Z, T)
            if not active(fault, "no_zero", j, onset):
                optimizer.zero_grad()
            E.backward()
            if active(fault, "wiped_grads", j, onset):
                wipe_grads(dlrm.parameters())
            optimizer.step()
            pull(j)
            diag.step(E, outputs=Z, batch=(X, lS_o, lS_i, T))
            if j % 20 == 19:
                with torch.no_grad():
                    Zv = dlrm(*val[:3])
                acc = float(((Zv > 0.5).float() == val[3]).float().mean())
                diag.log_eval(loss=loss_fn(Zv, val[3]).item(), accuracy=acc)
                scores.append(acc)
    progress = Progress("val accuracy", scores[0], scores[-1], higher_is_better=True, min_gain=0.04)
    return StyleRun(diag, fault_onset(fault, onset), steps, "bot_l.2", fault, progress, crash["error"], timer.seconds)

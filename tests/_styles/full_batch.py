"""Full-batch node classification in the style of PyTorch Geometric's ``examples/gcn.py``: a
two-layer GCN (``GCNConv`` = linear map + propagation over the symmetric-normalised adjacency with
self-loops, here a sparse ``torch.sparse.mm``) on a synthetic stochastic-block-model graph (300
nodes, 3 communities, weak node features), 20 labelled nodes per class, dropout 0.5, Adam at 0.01
with weight decay 5e-4 (Kipf's pygcn), and ``test()`` after **every** epoch: each step is
the whole graph, each step is followed by an evaluation.

Mechanisms: one batch repeated every step (a smooth training loss on 60 labelled nodes; the
validation loss bottoms out near step 60 and then drifts ~10 % up and down while validation accuracy
holds at ~0.8: ordinary for this setting, the script keeps the best epoch), an evaluation at every
step, outputs for all nodes while only the train mask enters the loss, sparse products in the forward.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      one_thread, session, shuffle, wipe_grads, Runaway, StaleEval, freeze_all_but_last, lr_jump,
                      orphan_params)
from ._common import PullBack

NAME = "full_batch"
DESCRIPTION = "PyG examples/gcn.py: 2-layer GCN on an SBM graph, full-batch Adam 0.01 wd 5e-4, test() every epoch"
FAULTS = {
    "nan": "log(0) inside the first graph convolution `conv1` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on (dropout off)",
    "shuffled_labels": "the training nodes' labels permuted at every step",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "runaway": "from onset - beta * ||conv2 weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `conv1` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the GCN toward a copy taken at onset after each step",
}
N, C, F_IN = 300, 3, 32


def sbm_graph(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(x, y, normalised adjacency, masks) of a 3-block stochastic block model."""
    g = torch.Generator().manual_seed(100 + seed)
    y = torch.arange(N) % C
    same = y[:, None] == y[None, :]
    prob = torch.where(same, torch.tensor(0.04), torch.tensor(0.015))
    upper = torch.triu((torch.rand(N, N, generator=g) < prob).float(), diagonal=1)
    adj = upper + upper.t() + torch.eye(N)
    dinv = adj.sum(1).rsqrt()
    norm = (dinv[:, None] * adj * dinv[None, :]).to_sparse()
    centroids = torch.randn(C, F_IN, generator=g)
    x = 0.3 * centroids[y] + torch.randn(N, F_IN, generator=g)
    perm = torch.randperm(N, generator=g)
    train = torch.cat([perm[y[perm] == c][:20] for c in range(C)])
    rest = perm[~torch.isin(perm, train)]
    masks = {name: torch.zeros(N, dtype=torch.bool).index_fill_(0, idx, True)
             for name, idx in (("train", train), ("val", rest[:100]), ("test", rest[100:]))}
    return x, y, norm, masks


class GCNConv(nn.Module):
    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.lin = nn.Linear(fin, fout, bias=False)
        self.bias = nn.Parameter(torch.zeros(fout))

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(adj, self.lin(x)) + self.bias


class GCN(nn.Module):
    def __init__(self, fin: int, hidden: int, fout: int) -> None:
        super().__init__()
        self.conv1 = GCNConv(fin, hidden)
        self.conv2 = GCNConv(hidden, fout)

    def forward(self, x: torch.Tensor, adj: torch.Tensor) -> torch.Tensor:
        x = F.dropout(x, p=0.5, training=self.training)
        x = self.conv1(x, adj).relu()
        x = F.dropout(x, p=0.5, training=self.training)
        return self.conv2(x, adj)


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    x, y, adj, masks = sbm_graph(seed)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = GCN(F_IN, 16, C)
    model.conv1 = NanGate(model.conv1)
    model.conv1.cut = fault == "detached"
    freeze_all_but_last(model, fault)
    lr = 0.01 * (1000 if fault == "lr_start" else 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    orphan_params(model, fault)
    runaway = Runaway(fault, onset, next(p for n, p in model.named_parameters() if n.startswith("conv2") and p.dim() >= 2))
    evaluated = StaleEval(model, fault, onset)
    train = masks["train"]
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for epoch in range(steps):
            if lr_jump(fault, epoch, onset):
                bump_lr(optimizer, 1000.0)
            model.conv1.arm(active(fault, "nan", epoch, onset))
            model.train(fault != "eval_mode")
            target = y.clone()
            if fault == "shuffled_labels":
                target[train] = shuffle(y[train], gen)
            if not active(fault, "no_zero", epoch, onset):
                optimizer.zero_grad()
            out_ = model(x, adj)
            loss = runaway(F.cross_entropy(out_[train], target[train]), epoch)
            loss.backward()
            if active(fault, "wiped_grads", epoch, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(epoch)
            diag.step(loss, outputs=out_, batch=(x, target))
            # test()
            net = evaluated.at(epoch)
            net.eval()
            with torch.no_grad():
                logits = net(x, adj)
            pred = logits.argmax(dim=-1)
            val = masks["val"]
            acc = float((pred[val] == y[val]).float().mean())
            diag.log_eval(loss=F.cross_entropy(logits[val], y[val]).item(), accuracy=acc)
            accs.append(acc)
    progress = Progress("val accuracy", accs[0], max(accs[-20:]), higher_is_better=True, min_gain=0.2)
    return StyleRun(diag, fault_onset(fault, onset), steps, "conv1", fault, progress, crash["error"], timer.seconds)

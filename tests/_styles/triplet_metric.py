"""Metric learning with a triplet loss as the common tutorials (and adambielski's
``siamese-triplet``) write it: a ``TripletDataset`` yielding (anchor, positive, negative) images, one
embedding network applied to the three, ``nn.TripletMarginLoss(margin=1.0)``, Adam at 1e-3, small
batches of 8 triplets, validation every 20 steps (triplet loss and nearest-centroid accuracy on
held-out digits). trackdiag gets ``batch=(anchor, positive, negative)``.

Mechanisms: a hinge loss that is **exactly 0** on many steps once the embedding separates the
classes (then every gradient is exactly zero and Adam's update decays to nothing), three float
tensors as the batch, embeddings as outputs rather than logits.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ._common import ZERO_INPUTS
from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, session, wipe_grads, SAME_BATCH, restart_loader, Runaway, StaleEval,
                      freeze_all_but_last, lr_jump, orphan_params, jump_factor, stop_if_nonfinite, DUP_WORKERS)
from ._common import PullBack

NAME = "triplet_metric"
DESCRIPTION = "siamese-triplet tutorials: TripletMarginLoss(margin=1) on (anchor, positive, negative), Adam, batch 8"
FAULTS = {
    "nan": "log(0) inside the embedding net's second layer `net.2` from onset",
    "lr1000": "Adam lr x1000 from onset",
    "crash_lr": "Adam lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "shuffled_labels": "triplets drawn with shuffled class labels (positives are random images)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "same_batch": SAME_BATCH,
    "zero_inputs": ZERO_INPUTS,
    "dup_workers": DUP_WORKERS,
    "tiny_subset": "the triplets come from 32 images; validation every 20 steps",
    "runaway": "from onset - beta * ||net.0 weight||^2 in the loss, beta annealed below zero",
    "detached": "the output of the gated layer `net.2` detached: it and the layers before never get a gradient",
    "frozen_majority": "every parameter but the last frozen; Adam over all",
    "not_landing": "the model's parameters replaced by copies after Adam was built",
    "eval_wrong": "validation runs on a copy of the model made before training, never refreshed",
    "reversed_ema": "from onset a reversed EMA update pulls the embedding net toward a copy taken at onset after each step",
}
BSZ = 8


class EmbeddingNet(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.PReLU(), nn.Linear(128, 64), nn.PReLU(), nn.Linear(64, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def triplets(x: torch.Tensor, y: torch.Tensor, gen: torch.Generator, bsz: int = BSZ) -> Iterator[tuple[torch.Tensor, ...]]:
    """TripletDataset + DataLoader(batch_size=8): a positive of the anchor's class, a negative of another."""
    by_class = [torch.nonzero(y == c).flatten() for c in range(10)]
    by_class = [idx if len(idx) else torch.arange(len(y)) for idx in by_class]
    while True:
        a = torch.randint(len(x), (bsz,), generator=gen)
        p = torch.stack([by_class[int(y[i])][torch.randint(len(by_class[int(y[i])]), (1,), generator=gen)][0] for i in a])
        n = torch.stack([_other(y, int(y[i]), gen) for i in a])
        yield x[a], x[p], x[n]


def _other(y: torch.Tensor, label: int, gen: torch.Generator) -> torch.Tensor:
    while True:
        j = torch.randint(len(y), (1,), generator=gen)[0]
        if int(y[j]) != label:
            return j


@torch.no_grad()
def centroid_accuracy(model: nn.Module, xtr: torch.Tensor, ytr: torch.Tensor, xva: torch.Tensor, yva: torch.Tensor) -> float:
    etr, eva = model(xtr), model(xva)
    cents = torch.stack([etr[ytr == c].mean(0) for c in range(10)])
    return float((torch.cdist(eva, cents).argmin(1) == yva).float().mean())


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = EmbeddingNet()
    model.net[2] = NanGate(model.net[2])
    model.net[2].cut = fault == "detached"
    freeze_all_but_last(model, fault)
    criterion = nn.TripletMarginLoss(margin=1.0, p=2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3 * (1000 if fault == "lr_start" else 1))
    orphan_params(model, fault)
    runaway, evaluated = Runaway(fault, onset, model.net[0].weight), StaleEval(model, fault, onset)
    labels = ytr[torch.randperm(len(ytr), generator=gen)] if fault == "shuffled_labels" else ytr
    tx, ty = (xtr[:32], labels[:32]) if fault == "tiny_subset" else (xtr, labels)
    loader = triplets(tx, ty, gen)
    loader = restart_loader(loader, fault, onset)
    val_triplets = next(triplets(xva, yva, torch.Generator().manual_seed(5), bsz=256))
    accs: list[float] = []
    pull = PullBack(fault, onset, model)
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if lr_jump(fault, step, onset):
                bump_lr(optimizer, jump_factor(fault))
            model.net[2].arm(active(fault, "nan", step, onset))
            anchor, positive, negative = next(loader)
            if not active(fault, "no_zero", step, onset):
                optimizer.zero_grad()
            loss = runaway(criterion(model(anchor), model(positive), model(negative)), step)
            stop_if_nonfinite(fault, loss)
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            optimizer.step()
            pull(step)
            diag.step(loss, batch=(anchor, positive, negative))
            if step % 20 == 0 or step == steps - 1:
                net = evaluated.at(step)
                net.eval()
                with torch.no_grad():
                    val_loss = criterion(*(net(t) for t in val_triplets)).item()
                acc = centroid_accuracy(net, xtr, ytr, xva, yva)
                diag.log_eval(loss=val_loss, accuracy=acc)
                accs.append(acc)
                model.train()
    progress = Progress("val nearest-centroid accuracy", accs[0], accs[-1], higher_is_better=True, min_gain=0.1)
    return StyleRun(diag, fault_onset(fault, onset), steps, "net.2", fault, progress, crash["error"], timer.seconds)

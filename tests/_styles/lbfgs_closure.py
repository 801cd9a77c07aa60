"""Full-batch L-BFGS with a closure, as PyTorch's ``examples/time_sequence_prediction`` drives its
model and as scikit-learn's ``MLPClassifier(solver="lbfgs")`` is often re-written in PyTorch: the
whole breast-cancer training table every step, an MLP with a single logit, ``BCEWithLogitsLoss``
plus an L2 penalty inside the closure, ``optim.LBFGS(lr=1, max_iter=3, history_size=10,
line_search_fn="strong_wolfe")`` and ``loss = optimizer.step(closure)``; validation every 20 steps.

Mechanisms: several forward/backward passes per optimizer step (the closure), a quasi-Newton step
whose size has nothing to do with a learning rate, a loss that reaches its floor within ~10 steps
and then sits there (gradient norm ~3e-5), a binary (single-logit) output. No learning-rate faults:
``lr`` is only the line search's first trial step, and the strong-Wolfe search shrinks it (x1000
from step 0 or mid-run trains exactly as well).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, check_fault, crash_guard, fault_onset,
                      one_thread, session, shuffle, sk_table, wipe_grads)

NAME = "lbfgs_closure"
DESCRIPTION = "time_sequence_prediction / MLPClassifier(lbfgs) rewrites: full-batch LBFGS(strong_wolfe), step(closure)"
FAULTS = {
    "nan": "log(0) inside the hidden layer `hidden` from onset",
    "no_zero": "optimizer.zero_grad() dropped from the closure from onset",
    "shuffled_labels": "targets permuted (the whole table is the batch)",
    "wiped_grads": "clip_grad_norm_(max_norm=0) inside the closure after backward from onset",
}
ALPHA = 1e-2


class Classifier(nn.Module):
    def __init__(self, d: int = 30, hidden: int = 16) -> None:
        super().__init__()
        self.hidden = nn.Linear(d, hidden)
        self.act = nn.Tanh()
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.hidden(x))).squeeze(-1)


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = sk_table("breast_cancer")
    ytr, yva = ytr.float(), yva.float()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if fault == "shuffled_labels":
        ytr = shuffle(ytr, gen)
    model = Classifier()
    model.hidden = NanGate(model.hidden)
    criterion = nn.BCEWithLogitsLoss()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=3,
                                  history_size=10, line_search_fn="strong_wolfe")
    accs: list[float] = []
    diag = session(model, optimizer, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for i in range(steps):
            model.hidden.arm(active(fault, "nan", i, onset))
            drop_zero = active(fault, "no_zero", i, onset)
            wipe = active(fault, "wiped_grads", i, onset)

            def closure() -> torch.Tensor:
                if not drop_zero:
                    optimizer.zero_grad()
                out_ = model(xtr)
                loss = criterion(out_, ytr) + ALPHA * sum(p.pow(2).sum() for n, p in model.named_parameters()
                                                          if n.endswith("weight"))
                loss.backward()
                if wipe:
                    wipe_grads(model.parameters())
                return loss

            loss = optimizer.step(closure)
            diag.step(loss, batch=(xtr, ytr))
            if i % 20 == 19:
                with torch.no_grad():
                    logits = model(xva)
                acc = float(((logits > 0).float() == yva).float().mean())
                diag.log_eval(loss=criterion(logits, yva).item(), accuracy=acc)
                accs.append(acc)
    progress = Progress("val accuracy", 0.5, accs[-1], higher_is_better=True, min_gain=0.3)
    return StyleRun(diag, fault_onset(fault, onset), steps, "hidden", fault, progress, crash["error"], timer.seconds)

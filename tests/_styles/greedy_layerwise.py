"""Greedy layer-wise pretraining of a stacked autoencoder, then supervised fine-tuning, as in the
classic stacked-denoising-autoencoder tutorials: each encoder/decoder pair has its own Adam
optimizer (all built up front and handed to trackdiag as a list), layer k is trained to rebuild the
output of the frozen layers below it (MSE, inputs computed under ``no_grad``), one layer after the
other, then the encoders and a new classifier head are fine-tuned with cross-entropy by a fifth
optimizer. Phases: 3 x ``steps // 5`` steps of pretraining, the rest fine-tuning.

Mechanisms: phases (the loss changes meaning and scale, ~0.01 MSE to ~2.3 cross-entropy, at a phase
boundary), optimizers idle for most of the run by design, parameters that get no gradient for long
stretches, a classifier head created at init but used only from the fine-tune phase on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      digits, fault_onset, one_thread, session, shuffle, wipe_grads)

NAME = "greedy_layerwise"
DESCRIPTION = "stacked-autoencoder tutorials: greedy layer-wise pretraining (one Adam per layer), then fine-tune"
FAULTS = {
    "nan": "log(0) inside the first encoder `encoders.0` from onset (pretraining phase 0)",
    "lr1000": "every optimizer's lr x1000 from onset",
    "lr_start": "every optimizer's lr x1000 from step 0",
    "no_zero": "the active optimizer's zero_grad() dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "shuffled_labels": "fine-tuning targets shuffled within each batch",
}
SIZES = (64, 48, 32, 16)
LR = 3e-3
PHASE = 60  # steps per pretraining phase
ACT = torch.relu


class StackedAutoencoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoders = nn.ModuleList(nn.Linear(a, b) for a, b in zip(SIZES, SIZES[1:]))
        self.decoders = nn.ModuleList(nn.Linear(b, a) for a, b in zip(SIZES, SIZES[1:]))
        self.classifier = nn.Linear(SIZES[-1], 10)

    def encode(self, x: torch.Tensor, depth: int) -> torch.Tensor:
        for enc in self.encoders[:depth]:
            x = ACT(enc(x))
        return x

    def reconstruct(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Layer k's autoencoder on the representation of the layers below."""
        return self.decoders[k](ACT(self.encoders[k](h)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encode(x, len(self.encoders)))


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = StackedAutoencoder()
    model.encoders[0] = NanGate(model.encoders[0])
    lr = LR * (1000 if fault == "lr_start" else 1)
    layer_opts = [torch.optim.Adam([*model.encoders[k].parameters(), *model.decoders[k].parameters()], lr=lr)
                  for k in range(len(model.encoders))]
    finetune_opt = torch.optim.Adam([*model.encoders.parameters(), *model.classifier.parameters()], lr=lr)
    optimizers = [*layer_opts, finetune_opt]
    phase_len = PHASE
    loader = batches(xtr, ytr, 32, gen)
    accs: list[float] = []
    diag = session(model, optimizers, out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        model.train()
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                for opt in optimizers:
                    bump_lr(opt, 1000.0)
            model.encoders[0].arm(active(fault, "nan", step, onset))
            x, y = next(loader)
            k = step // phase_len
            if k < len(layer_opts):  # pretraining layer k
                opt = layer_opts[k]
                with torch.no_grad():
                    h = model.encode(x, k)
                out_ = model.reconstruct(h, k)
                loss = F.mse_loss(out_, h)
                target = h
            else:  # fine-tuning the whole stack
                opt = finetune_opt
                if fault == "shuffled_labels":
                    y = shuffle(y, gen)
                out_ = model(x)
                loss = F.cross_entropy(out_, y)
                target = y
            if not active(fault, "no_zero", step, onset):
                opt.zero_grad()
            loss.backward()
            if active(fault, "wiped_grads", step, onset):
                wipe_grads(model.parameters())
            opt.step()
            diag.step(loss, outputs=out_, batch=(x, target))
            if k >= len(layer_opts) and (step - 3 * phase_len) % 20 == 0:
                model.eval()
                with torch.no_grad():
                    logits = model(xva)
                    acc = float((logits.argmax(1) == yva).float().mean())
                    diag.log_eval(loss=F.cross_entropy(logits, yva).item(), accuracy=acc)
                accs.append(acc)
                model.train()
    progress = Progress("val accuracy in fine-tuning", accs[0] if accs else 0.0, accs[-1] if accs else 0.0,
                        higher_is_better=True, min_gain=0.3)
    start = 3 * phase_len if fault == "shuffled_labels" else fault_onset(fault, onset)  # labels used from then
    return StyleRun(diag, start, steps, "encoders.0", fault, progress, crash["error"], timer.seconds)

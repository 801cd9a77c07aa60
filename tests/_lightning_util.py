"""The Lightning module and reference callback of tests/test_lightning.py, in a module of their own so that Lightning
(~3 s of CPU to import: it imports transformers too) is imported by that module's first test, not by every xdist
worker that collects the suite (issue 47)."""
from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from _clip import clip_checked


class Poison(nn.Module):
    """Identity until its ``armed`` buffer is set, then log(0) = -inf: a fault inside a named module."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("armed", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x * 0.0) if bool(self.armed) else x


class DigitsNet(pl.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), Poison())
        self.head = nn.Linear(64, 10)
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        out = self(x)
        loss = nn.functional.cross_entropy(out, y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return {"loss": loss, "logits": out}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        out = self(x)
        self.log("val_loss", nn.functional.cross_entropy(out, y))
        self.log("val_acc", (out.argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Reference(pl.Callback):
    """Pre-clip norm per optimizer step (``clip_grad_norm_`` with an infinite max: changes nothing)."""

    def __init__(self, arm_at: int | None = None) -> None:
        self.norms: dict[int, float] = {}
        self.evals: list[int] = []  # the step each validation follows
        self.arm_at = arm_at

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.evals.append(trainer.global_step - 1)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.arm_at:
            pl_module.body[4].armed.fill_(1.0)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.norms[trainer.global_step] = clip_checked(pl_module.parameters(), math.inf).item()

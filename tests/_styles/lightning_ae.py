"""A ``LightningModule`` as in Lightning's README (``LitAutoEncoder``): an encoder/decoder MLP,
``training_step`` that unpacks ``x, _ = batch`` (the digit labels ride along unused), reconstructs
and returns ``F.mse_loss``, ``self.log("train_loss", ...)``, a ``validation_step`` logging
``val_loss``, ``configure_optimizers`` returning Adam, and ``pl.Trainer(max_steps=..., callbacks=[
DiagnosticsCallback(...)], gradient_clip_val=1.0, val_check_interval=20)`` with the default
sanity-check validation. trackdiag is wired only through
``trackdiag.integrations.lightning.DiagnosticsCallback``.

Mechanisms: the framework owns the loop, the optimizer call (``optimizer.step(closure)``) and the
clipping; a reconstruction loss (MSE ~0.07 to ~0.02) with no outputs passed; validation driven by
Lightning's ``val_check_interval``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, digits,
                      fault_onset, one_thread, quiet_probes, wipe_grads, jump_factor, lr_jump, stop_if_nonfinite)

NAME = "lightning_ae"
DESCRIPTION = "Lightning README LitAutoEncoder: LightningModule + Trainer, trackdiag through DiagnosticsCallback"
FAULTS = {
    "nan": "log(0) inside the encoder's second layer `encoder.2` from onset",
    "lr1000": "Adam lr x1000 from onset (set in on_train_batch_start)",
    "crash_lr": "Adam lr x1e6 from onset (set in on_train_batch_start); the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "lr_start": "Adam lr x1000 from step 0",
    "no_zero": "optimizer_zero_grad overridden to do nothing from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) in on_after_backward from onset",
    "tiny_subset": "limit_train_batches=2; validation every 20 steps",
}


def lit_autoencoder(fault: str | None, onset: int, lr: float) -> Any:
    import lightning.pytorch as pl

    class LitAutoEncoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
            self.decoder = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 64))
            self.val_losses: list[float] = []

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder(self.encoder(x))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            x = x.view(x.size(0), -1)
            x_hat = self(x)
            loss = F.mse_loss(x_hat, x)
            stop_if_nonfinite(fault, loss)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, _ = batch
            loss = F.mse_loss(self(x), x)
            self.log("val_loss", loss)
            self.val_losses.append(float(loss))  # the first is the sanity check's, before training

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=lr)

        # fault plumbing: what a user's overrides would do
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            step = self.trainer.global_step
            if lr_jump(fault, step, onset):
                bump_lr(self.trainer.optimizers[0], jump_factor(fault))
            self.encoder[2].arm(active(fault, "nan", step, onset))

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            if not active(fault, "no_zero", self.trainer.global_step, onset):
                optimizer.zero_grad()

        def on_after_backward(self) -> None:
            if active(fault, "wiped_grads", self.trainer.global_step, onset):
                wipe_grads(self.parameters())

    return LitAutoEncoder()


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from trackdiag.integrations.lightning import DiagnosticsCallback

    check_fault(fault, FAULTS)
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    timer = Timer()
    xtr, ytr, xva, yva = digits()
    pl.seed_everything(seed, verbose=False)
    model = lit_autoencoder(fault, onset, 1e-3 * (1000 if fault == "lr_start" else 1))
    model.encoder[2] = NanGate(model.encoder[2])
    gen = torch.Generator().manual_seed(seed)
    train_loader = DataLoader(TensorDataset(xtr, ytr), batch_size=32, shuffle=True, drop_last=True, generator=gen)
    val_loader = DataLoader(TensorDataset(xva, yva), batch_size=360)
    probes = quiet_probes(**diag_overrides.pop("probes", {}))
    diag = DiagnosticsCallback(level=level, sinks=diag_overrides.pop("sinks", ["local"]), output_dir=str(out),
                               probes=probes, **diag_overrides)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=[diag], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         gradient_clip_val=1.0, val_check_interval=20, check_val_every_n_epoch=None,
                         limit_train_batches=2 if fault == "tiny_subset" else None, default_root_dir=str(out))
    with crash_guard(fault) as crash, one_thread():
        trainer.fit(model, train_loader, val_loader)
    vl = model.val_losses or [float("nan")]
    progress = Progress("val reconstruction MSE", vl[0], vl[-1], min_gain=0.02)
    return StyleRun(diag, fault_onset(fault, onset), steps, "encoder.2", fault, progress, crash["error"], timer.seconds)

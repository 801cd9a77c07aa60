"""A home-grown ``Trainer`` class of the kind many projects write (fit/training_step/callbacks,
Keras- or Lightning-like): the optimizer and scheduler are built **inside** ``fit()`` by
``configure_optimizers()`` (SGD with Nesterov momentum 0.9 and ``StepLR``), so the user's script
never holds them: ``Diagnostics(model)`` is created without an optimizer (the README's "trainer
that builds its optimizer itself") and a callback calls ``diag.step`` after each batch and
``diag.log_eval`` after each epoch's validation. Data: scikit-learn's wine table (142 training
rows, batch 16: an epoch is 8 steps), an MLP with BatchNorm and Dropout.

Mechanisms: an optimizer the session only meets at its first step, epochs of 8 steps, a
scheduler that halves the learning rate every 100 steps, BatchNorm on tabular data.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, batches, bump_lr, check_fault, crash_guard,
                      fault_onset, one_thread, session, shuffle, sk_table, wipe_grads, lr_jump, stop_if_nonfinite, jump_factor)
from ._common import PullBack

NAME = "trainer_owned_optimizer"
DESCRIPTION = "a home-grown Trainer that builds SGD+StepLR inside fit(); Diagnostics(model) without an optimizer"
FAULTS = {
    "nan": "log(0) inside the second linear layer `body.4` from onset",
    "lr1000": "the trainer's SGD lr (and StepLR's base) x1000 from onset",
    "lr_start": "the trainer's SGD lr x1000 from step 0",
    "no_zero": "optimizer.zero_grad() dropped from onset",
    "eval_mode": "model.eval() left on before fit (BatchNorm frozen at init statistics, Dropout off)",
    "shuffled_labels": "targets shuffled within each batch",
    "wiped_grads": "clip_grad_norm_(max_norm=0) between backward and step from onset",
    "tiny_subset": "trains on two batches; validation every 10 epochs (20 steps: the corpus' tiny_subset cadence)",
    "crash_lr": "the trainer's SGD lr x1e6 from onset; the script stops once the loss is not finite",
    "sched_per_batch": "every learning rate x0.1 every 30 steps from step 0 (StepLR(step_size=30) meant per epoch, stepped per batch)",
    "reversed_ema": "from onset a reversed EMA hook pulls the model toward a copy taken at onset before each batch",
}


class WineNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(13, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2),
                                  nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Trainer:
    val_every_epochs = 1  # Lightning's check_val_every_n_epoch
    def __init__(self, model: nn.Module, train: tuple[torch.Tensor, torch.Tensor], val: tuple[torch.Tensor, torch.Tensor],
                 *, lr: float, max_steps: int, batch_size: int, seed: int, callbacks: list[Any]) -> None:
        self.model, self.train_data, self.val_data = model, train, val
        self.lr, self.max_steps, self.batch_size = lr, max_steps, batch_size
        self.callbacks = callbacks
        self.gen = torch.Generator().manual_seed(seed)
        self.global_step = 0

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, Any]:
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=100, gamma=0.5)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits, y), logits

    def fit(self) -> None:
        self.optimizer, self.scheduler = self.configure_optimizers()
        loader = batches(*self.train_data, self.batch_size, self.gen)
        steps_per_epoch = max(1, len(self.train_data[0]) // self.batch_size)
        self.model.train()
        self.on_fit_start()
        epoch = 0
        while self.global_step < self.max_steps:
            epoch += 1
            for _ in range(steps_per_epoch):
                batch = self.on_before_batch(next(loader))
                if self.zero_grad_enabled():
                    self.optimizer.zero_grad()
                loss, logits = self.training_step(batch)
                stop_if_nonfinite(getattr(self, "fault", None), loss)
                loss.backward()
                self.on_after_backward()
                self.optimizer.step()
                self.scheduler.step()
                for cb in self.callbacks:
                    cb.on_train_batch_end(self, loss, logits, batch)
                self.global_step += 1
                if self.global_step >= self.max_steps:
                    break
            if epoch % self.val_every_epochs == 0:
                self.validate()

    # overridable hooks (no-ops here)
    def on_fit_start(self) -> None: ...

    def on_before_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return batch

    def zero_grad_enabled(self) -> bool:
        return True

    def on_after_backward(self) -> None: ...

    @torch.no_grad()
    def validate(self) -> None:
        was_training = self.model.training
        self.model.eval()
        x, y = self.val_data
        logits = self.model(x)
        metrics = {"val_loss": F.cross_entropy(logits, y).item(), "val_acc": float((logits.argmax(1) == y).float().mean())}
        self.model.train(was_training)
        for cb in self.callbacks:
            cb.on_validation_end(self, metrics)


class FaultyTrainer(Trainer):
    """The same trainer with one fault planted through its hooks."""

    def __init__(self, *args: Any, fault: str | None, onset: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fault, self.onset = fault, onset
        self.pull = PullBack(fault, onset, self.model)  # a user's EMA hook run before each batch, written backwards

    def on_fit_start(self) -> None:
        if self.fault == "eval_mode":
            self.model.eval()

    def on_before_batch(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self.pull(self.global_step - 1)  # after the previous step's optimizer step
        if lr_jump(self.fault, self.global_step, self.onset):
            bump_lr(self.optimizer, jump_factor(self.fault), self.scheduler)
        self.model.body[4].arm(active(self.fault, "nan", self.global_step, self.onset))
        return (batch[0], shuffle(batch[1], self.gen)) if self.fault == "shuffled_labels" else batch

    def zero_grad_enabled(self) -> bool:
        return not active(self.fault, "no_zero", self.global_step, self.onset)

    def on_after_backward(self) -> None:
        if active(self.fault, "wiped_grads", self.global_step, self.onset):
            wipe_grads(self.model.parameters())


class DiagnosticsHook:
    """The user's bridge: one diag.step per batch, validation metrics to log_eval."""

    def __init__(self, diag: Any) -> None:
        self.diag = diag
        self.accs: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, loss: torch.Tensor, logits: torch.Tensor, batch: Any) -> None:
        self.diag.step(loss, outputs=logits, batch=batch)

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.diag.log_eval(loss=metrics["val_loss"], accuracy=metrics["val_acc"])
        self.accs.append(metrics["val_acc"])


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    xtr, ytr, xva, yva = sk_table("wine")
    if fault == "tiny_subset":
        xtr, ytr = xtr[:32], ytr[:32]
    torch.manual_seed(seed)
    model = WineNet()
    model.body[4] = NanGate(model.body[4])
    diag = session(model, None, out, level, **diag_overrides)
    bridge = DiagnosticsHook(diag)
    trainer = FaultyTrainer(model, (xtr, ytr), (xva, yva), lr=0.05 * (1000 if fault == "lr_start" else 1),
                            max_steps=steps, batch_size=16, seed=seed, callbacks=[bridge], fault=fault, onset=onset)
    trainer.val_every_epochs = 10 if fault == "tiny_subset" else 1  # two batches: an epoch is 2 steps
    with crash_guard(fault) as crash, one_thread(), diag:
        trainer.fit()
    accs = bridge.accs or [0.0]
    progress = Progress("val accuracy", 1 / 3, max(accs[-5:]), higher_is_better=True, min_gain=0.4)
    return StyleRun(diag, fault_onset(fault, onset), steps, "body.4", fault, progress, crash["error"], timer.seconds)

"""Lightning 2.x with trackdiag: an MLP on scikit-learn's bundled digits (no download).

    python examples/lightning_train.py                      # diagnostics in the MLFlowLogger's run (./mlflow.db)
    python examples/lightning_train.py --fault-step 60      # a NaN made inside `body.2` at step 60: named, and stopped
    python examples/lightning_train.py --accumulate 4 --amp # gradient accumulation, fp16 autocast + GradScaler
    python examples/lightning_train.py --logger wandb       # into the WandbLogger's run (WANDB_MODE=offline works)

The trackdiag part is the three marked lines; the rest is an ordinary Lightning script.
"""
from __future__ import annotations

import argparse
import logging

import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from torch import nn

from trackdiag.integrations.lightning import DiagnosticsCallback  # trackdiag (1/3)


class Fault(nn.Module):
    """Identity until ``armed`` is set, then log(0) = -inf (a stand-in for a numerically unsafe op)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("armed", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x * 0.0) if bool(self.armed) else x


class DigitsNet(pl.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 128, fault_step: int = -1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.body = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), Fault(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        if self.global_step == self.hparams.fault_step:
            self.body[2].armed.fill_(1.0)
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return {"loss": loss, "logits": logits}  # logits: optional, feeds the output-diversity checks

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(-1) == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def loaders(batch_size: int) -> tuple[torch.utils.data.DataLoader, torch.utils.data.DataLoader]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, val = perm[:1400], perm[1400:]
    return (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]), batch_size, shuffle=True),
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[val], y[val]), 256))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--level", default="advanced", choices=["basic", "advanced", "extreme"])
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--amp", action="store_true", help="fp16 autocast with a GradScaler (on CPU: the plugin, explicitly)")
    p.add_argument("--fault-step", type=int, default=-1)
    p.add_argument("--logger", default="mlflow", choices=["mlflow", "wandb", "none"])
    p.add_argument("--tracking-uri", default="sqlite:///mlflow.db")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)

    logger: object = False
    if args.logger == "mlflow":
        logger = pl.loggers.MLFlowLogger(experiment_name="lightning-digits", tracking_uri=args.tracking_uri)
    elif args.logger == "wandb":
        logger = pl.loggers.WandbLogger(project="lightning-digits")
    plugins = []
    if args.amp:  # Trainer(precision="16-mixed") does this on a GPU; on a CPU Lightning would switch to bf16
        from lightning.pytorch.plugins.precision import MixedPrecision
        plugins.append(MixedPrecision("16-mixed", "cuda" if torch.cuda.is_available() else "cpu"))

    diag = DiagnosticsCallback(args.level, rules={"nonfinite_loss": {"action": "stop"}})  # trackdiag (2/3)
    trainer = pl.Trainer(max_steps=args.steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=1.0,
                         logger=logger, callbacks=[diag], plugins=plugins, val_check_interval=50,
                         check_val_every_n_epoch=None, log_every_n_steps=10, enable_checkpointing=False)
    trainer.fit(DigitsNet(fault_step=args.fault_step), *loaders(32))
    logging.getLogger("example").info("alerts: %s", diag.summary()["alerts"] or "none")  # trackdiag (3/3): diag.alerts too


if __name__ == "__main__":
    main()

"""A 2-process Lightning DDP fit on CPU (gloo), launched by Lightning itself, for tests/test_lightning.py:
``python _lightning_ddp_worker.py OUT MLFLOW_URI``.

Lightning's own launcher re-runs this script for rank 1 (as a user's ``python train.py`` would be).
At step 5 rank 1's batch holds a NaN; ``nonfinite_loss`` has action ``stop``. Each rank writes
``OUT/rank<N>.json``: the step it stopped at, its alerts, and what the callback saw.
"""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger
from trackdiag.integrations.lightning import DiagnosticsCallback

NAN_STEP, EVERY = 5, 4


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_rank == 1 and self.trainer.global_step == NAN_STEP:
            x = x.clone()
            x[0, 0] = float("nan")
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    warnings.filterwarnings("ignore")
    out, uri = Path(sys.argv[1]), sys.argv[2]
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(512, 8, generator=gen), torch.randint(0, 4, (512,), generator=gen))
    cb = DiagnosticsCallback("basic", every=EVERY, output_dir=str(out / "run"),
                             rules={"nonfinite_loss": {"action": "stop"}}, sink={"mlflow": {"delivery": "thread"}})
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=30, logger=MLFlowLogger("ddp", tracking_uri=uri),
                         callbacks=[cb], log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(), torch.utils.data.DataLoader(data, batch_size=8))
    rank = trainer.global_rank
    result = {"rank": rank, "global_step": trainer.global_step, "diag_steps": cb.summary()["steps"],
              "should_stop": cb.diag.should_stop, "alerts": [a.to_dict() for a in cb.alerts]}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()

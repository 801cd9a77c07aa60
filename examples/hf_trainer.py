"""The Hugging Face Trainer with trackdiag: a 2-layer GPT-2, built from a config (no download),
learning this repository's README byte by byte.

    python examples/hf_trainer.py                          # diagnostics in the Trainer's MLflow run (./mlflow.db)
    python examples/hf_trainer.py --fault-step 40          # a NaN inside transformer.h.1.mlp.act at step 40: the
                                                           #   Trainer logs loss 0 and trains on; trackdiag names it
    python examples/hf_trainer.py --report-to wandb        # into the Trainer's W&B run (WANDB_MODE=offline works)
    python examples/hf_trainer.py --accumulate 4

The trackdiag part is the three marked lines; the rest is an ordinary Trainer script.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from trackdiag.integrations.transformers import DiagnosticsCallback  # trackdiag (1/3)  # noqa: E402

log = logging.getLogger("example")
README = Path(__file__).resolve().parents[1] / "README.md"


class Bytes(torch.utils.data.Dataset):
    """Windows of ``block`` bytes of a text; the labels are the inputs (the model shifts them)."""

    def __init__(self, text: str, block: int = 64) -> None:
        self.data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.data[i * self.block:(i + 1) * self.block]
        return {"input_ids": ids, "labels": ids.clone()}


class Fault(nn.Module):
    """Wraps an activation; once ``armed`` it returns log(0) = -inf (a numerically unsafe op)."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act
        self.register_buffer("armed", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(x)
        return torch.log(y * 0.0) if bool(self.armed) else y


class ArmFault(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):  # noqa: ANN001, ANN201 - HF's signature
        if state.global_step == self.step:
            model.transformer.h[1].mlp.act.armed.fill_(1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--level", default="advanced", choices=["basic", "advanced", "extreme"])
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=-1)
    p.add_argument("--report-to", default="mlflow", choices=["mlflow", "wandb", "none"])
    p.add_argument("--output-dir", default="hf_output")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.report_to == "mlflow":
        os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
        os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "hf-readme-bytes")

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    model.transformer.h[1].mlp.act = Fault(model.transformer.h[1].mlp.act)
    text = README.read_text(encoding="utf-8")
    cut = int(0.9 * len(text))
    training = TrainingArguments(output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8,
                                 gradient_accumulation_steps=args.accumulate, learning_rate=3e-3, max_grad_norm=1.0,
                                 logging_steps=10, eval_strategy="steps", eval_steps=50, save_strategy="no",
                                 report_to=[] if args.report_to == "none" else [args.report_to], use_cpu=True,
                                 disable_tqdm=True)
    diag = DiagnosticsCallback(args.level, rules={"nonfinite_loss": {"action": "stop"}})  # trackdiag (2/3)
    callbacks = [diag] + ([ArmFault(args.fault_step)] if args.fault_step >= 0 else [])
    Trainer(model=model, args=training, train_dataset=Bytes(text[:cut]), eval_dataset=Bytes(text[cut:]),
            callbacks=callbacks).train()
    log.info("alerts: %s", diag.summary()["alerts"] or "none")  # trackdiag (3/3): diag.alerts too
    if args.report_to == "wandb":
        import wandb

        wandb.finish()


if __name__ == "__main__":
    main()

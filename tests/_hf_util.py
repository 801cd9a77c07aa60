"""Tiny Hugging Face models built from configs (no download), learnable synthetic data, and
callbacks that record what the Trainer itself logs, for tests/test_hf_trainer.py."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from transformers import (BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          TrainerCallback, TrainingArguments)

VOCAB, LENGTH = 64, 16


class Poison(nn.Module):
    """Wraps an activation; once its ``armed`` buffer is set it returns log(0) = -inf."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act
        self.register_buffer("armed", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(x)
        return torch.log(y * 0.0) if bool(self.armed) else y


def gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A 2-layer GPT-2 (32-wide) whose ``transformer.h.1.mlp.act`` is a :class:`Poison`."""
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    model.transformer.h[1].mlp.act = Poison(model.transformer.h[1].mlp.act)
    return model


def bert(seed: int = 0) -> BertForSequenceClassification:
    """A 2-layer BERT (32-wide) classifying sequences into 2 classes."""
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)
    return BertForSequenceClassification(cfg)


class Progressions(torch.utils.data.Dataset):
    """Token sequences ``a, a+k, a+2k, ...`` mod VOCAB: the next token is learnable from the last two.
    ``labels``: the sequence itself (causal LM) or, with ``classify``, whether k is odd."""

    def __init__(self, n: int, seed: int = 0, classify: bool = False) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.start = torch.randint(0, VOCAB, (n,), generator=gen)
        self.step = torch.randint(1, 8, (n,), generator=gen)
        self.classify = classify

    def __len__(self) -> int:
        return len(self.start)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (self.start[i] + self.step[i] * torch.arange(LENGTH)) % VOCAB
        labels = (self.step[i] % 2) if self.classify else ids.clone()
        return {"input_ids": ids, "labels": labels}


def arguments(out: Path, **kw: Any) -> TrainingArguments:
    """CPU, no checkpoints, no progress bar, every step logged, nothing reported unless asked."""
    base = dict(output_dir=str(out / "hf"), per_device_train_batch_size=8, per_device_eval_batch_size=16,
                learning_rate=1e-3, max_steps=12, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                disable_tqdm=True, seed=0, dataloader_num_workers=0)
    return TrainingArguments(**{**base, **kw})


class Recorder(TrainerCallback):
    """What the Trainer logs (``on_log``) and evaluates (``on_evaluate``), keyed like trackdiag's steps
    (the Trainer stamps a step's logs with ``global_step`` after counting it: key = that - 1); arms the
    model's :class:`Poison` at the start of step ``arm_at`` (``state.global_step`` while it runs)."""

    def __init__(self, arm_at: int | None = None) -> None:
        self.logs: dict[int, dict[str, float]] = {}
        self.evals: dict[int, dict[str, float]] = {}
        self.arm_at = arm_at

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        if self.arm_at is not None and state.global_step == self.arm_at:
            model.transformer.h[1].mlp.act.armed.fill_(1.0)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.logs[state.global_step - 1] = dict(logs)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None,
                    **kw: Any) -> None:
        self.evals[state.global_step - 1] = dict(metrics or {})


def accuracy(pred: Any) -> dict[str, float]:
    return {"accuracy": float((pred.predictions.argmax(-1) == pred.label_ids).mean())}

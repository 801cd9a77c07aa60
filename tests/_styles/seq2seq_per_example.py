"""Sequence-to-sequence in the style of PyTorch's "NLP From Scratch: Translation with a Sequence to
Sequence Network" tutorial (the per-sentence version): an ``EncoderRNN`` and a ``DecoderRNN`` (GRU,
one token per call, ``LogSoftmax`` + ``NLLLoss``), **one sentence per optimizer step**, the loss
**summed** over the target tokens (``loss += criterion(...)``), teacher forcing with probability
0.5 (otherwise the decoder's own guesses, stopping at EOS), and two SGD optimizers,
``encoder_optimizer`` and ``decoder_optimizer``. The "translation" here: a word of the corpus to the
word reversed, character by character. trackdiag gets the two networks and their optimizers as
dicts and the summed loss.

Mechanisms: batch size 1, a loss whose scale follows the sentence length (3-7 tokens) and the
teacher-forcing coin, two components with one shared loss, Python loops over time steps.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._common import (NanGate, Progress, StyleRun, Timer, active, bump_lr, check_fault, crash_guard, fault_onset,
                      mean, one_thread, session, wipe_grads)
from ._common import PullBack

NAME = "seq2seq_per_example"
DESCRIPTION = "PyTorch seq2seq translation tutorial: GRU encoder/decoder, one sentence per step, summed NLL, 2 SGDs"
FAULTS = {
    "nan": "log(0) inside the decoder's GRU `decoder.gru` from onset",
    "lr1000": "both SGD learning rates x1000 from onset",
    "lr_start": "both SGD learning rates x1000 from step 0",
    "no_zero": "both zero_grad() calls dropped from onset",
    "wiped_grads": "clip_grad_norm_(max_norm=0) on both networks between backward and step from onset",
    "reversed_ema": "from onset a reversed EMA update pulls both nets toward a copy taken at onset after each step",
}
SOS, EOS, HIDDEN = 0, 1, 64


class EncoderRNN(nn.Module):
    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.embedding = nn.Embedding(input_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)

    def forward(self, input: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        return self.gru(self.embedding(input).view(1, 1, -1), hidden)

    def initHidden(self) -> torch.Tensor:  # noqa: N802 - the tutorial's name
        return torch.zeros(1, 1, self.hidden_size)


class DecoderRNN(nn.Module):
    def __init__(self, hidden_size: int, output_size: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(output_size, hidden_size)
        self.gru = nn.GRU(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, output_size)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, input: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: A002
        output = F.relu(self.embedding(input).view(1, 1, -1))
        output, hidden = self.gru(output, hidden)
        return self.softmax(self.out(output[0])), hidden


def pairs() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """(word, reversed word) index tensors of 3-6-letter corpus words, ids 2.. (0 SOS, 1 EOS)."""
    from _loops import names_data

    seqs, vocab = names_data()
    out = []
    for s in seqs:
        if 3 <= len(s) <= 6:
            ids = [c + 1 for c in s]  # names_data ids start at 1
            out.append((torch.tensor(ids + [EOS]).view(-1, 1), torch.tensor(ids[::-1] + [EOS]).view(-1, 1)))
    return out, vocab + 1


def train(input_tensor: torch.Tensor, target_tensor: torch.Tensor, encoder: EncoderRNN, decoder: DecoderRNN,
          criterion: nn.Module, rng: random.Random, teacher_forcing_ratio: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    encoder_hidden = encoder.initHidden()
    loss = torch.zeros(())
    for ei in range(input_tensor.size(0)):
        _, encoder_hidden = encoder(input_tensor[ei], encoder_hidden)
    decoder_input = torch.tensor([[SOS]])
    decoder_hidden = encoder_hidden
    use_teacher_forcing = rng.random() < teacher_forcing_ratio
    for di in range(target_tensor.size(0)):
        decoder_output, decoder_hidden = decoder(decoder_input, decoder_hidden)
        loss = loss + criterion(decoder_output, target_tensor[di])
        if use_teacher_forcing:
            decoder_input = target_tensor[di]
        else:
            _, topi = decoder_output.topk(1)
            decoder_input = topi.squeeze().detach()
            if decoder_input.item() == EOS:
                break
    return loss, decoder_output


def run(out: Path, *, level: str = "advanced", seed: int = 0, steps: int = 300, fault: str | None = None,
        onset: int = 40, **diag_overrides: Any) -> StyleRun:
    check_fault(fault, FAULTS)
    timer = Timer()
    data, vocab = pairs()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    encoder, decoder = EncoderRNN(vocab, HIDDEN), DecoderRNN(HIDDEN, vocab)
    decoder.gru = NanGate(decoder.gru)
    lr = 0.05 * (1000 if fault == "lr_start" else 1)
    encoder_optimizer = torch.optim.SGD(encoder.parameters(), lr=lr)
    decoder_optimizer = torch.optim.SGD(decoder.parameters(), lr=lr)
    criterion = nn.NLLLoss()
    per_token: list[float] = []
    pull = PullBack(fault, onset, encoder, decoder)
    diag = session({"encoder": encoder, "decoder": decoder}, {"encoder": encoder_optimizer, "decoder": decoder_optimizer},
                   out, level, **diag_overrides)
    with crash_guard(fault) as crash, one_thread(), diag:
        for it in range(steps):
            if fault == "lr1000" and it == onset:
                bump_lr(encoder_optimizer, 1000.0)
                bump_lr(decoder_optimizer, 1000.0)
            decoder.gru.arm(active(fault, "nan", it, onset))
            input_tensor, target_tensor = rng.choice(data)
            if not active(fault, "no_zero", it, onset):
                encoder_optimizer.zero_grad()
                decoder_optimizer.zero_grad()
            loss, _ = train(input_tensor, target_tensor, encoder, decoder, criterion, rng)
            loss.backward()
            if active(fault, "wiped_grads", it, onset):
                wipe_grads([*encoder.parameters(), *decoder.parameters()])
            encoder_optimizer.step()
            decoder_optimizer.step()
            pull(it)
            per_token.append(loss.item() / target_tensor.size(0))
            diag.step(loss)
    progress = Progress("loss per target token", mean(per_token[:30]), mean(per_token[-30:]), min_gain=0.3)
    return StyleRun(diag, fault_onset(fault, onset), steps, "decoder.gru", fault, progress, crash["error"],
                    timer.seconds)

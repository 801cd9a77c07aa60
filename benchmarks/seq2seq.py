"""The short-step workload of issue 30 (item 6): a GRU encoder/decoder trained **one sentence per
step**, as PyTorch's "Translation with a Sequence to Sequence Network" tutorial does it.

Batch 1, 5-10 source tokens and 5-10 target tokens per sentence; the encoder is called once per source
token and the decoder once per target token in a Python loop (teacher forcing), the summed NLL loss;
two optimizers, ``encoder`` and ``decoder`` (AdamW here, like every other arm; the tutorial's SGD steps
the same way), both stepped after the one backward pass; trackdiag gets the two networks and their
optimizers as dicts, as the README/docs show for several models, and ``diag.step(loss)`` once per
sentence. A step is ~2 ms on a 2-core CPU: ~40 module calls of tiny tensors, where fixed per-step and
per-call Python costs are most of what a diagnostics library can cost. The task is learnable (the target
is the source reversed), so the timed run is a healthy one.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workloads import Workload

SOS, EOS, VOCAB, HIDDEN = 0, 1, 32, 64


class Encoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.hidden = hidden
        self.embedding = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(self.embedding(token).view(1, 1, -1), h)


class Decoder(nn.Module):
    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, hidden)
        self.gru = nn.GRU(hidden, hidden)
        self.out = nn.Linear(hidden, vocab)
        self.softmax = nn.LogSoftmax(dim=1)

    def forward(self, token: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = F.relu(self.embedding(token).view(1, 1, -1))
        x, h = self.gru(x, h)
        return self.softmax(self.out(x[0])), h


class Seq2Seq(nn.Module):
    """Holds the two networks (one object for the benchmark's arms); the session gets them apart."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder, self.decoder = Encoder(), Decoder()


def _sentence(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A source sentence of 5-10 tokens (ids 2..) and its target: the source reversed, then EOS."""
    n = int(torch.randint(5, 11, (), generator=g, device=g.device))
    src = torch.randint(2, VOCAB, (n,), generator=g, device=g.device)
    return src, torch.cat([src.flip(0), src.new_tensor([EOS])])


def _translate(model: Seq2Seq, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tutorial's ``train()`` body: one encoder call per source token, one decoder call per target
    token (teacher forcing), the NLL summed over the target. Returns (loss, last decoder output)."""
    src, tgt = batch
    h = torch.zeros(1, 1, model.encoder.hidden, device=src.device)
    for i in range(src.shape[0]):
        _, h = model.encoder(src[i:i + 1], h)
    token = src.new_tensor([SOS])
    loss = torch.zeros((), device=src.device)
    out: Any = None
    for i in range(tgt.shape[0]):
        out, h = model.decoder(token, h)
        loss = loss + F.nll_loss(out, tgt[i:i + 1])
        token = tgt[i:i + 1]
    return loss, out


SEQ2SEQ = Workload("seq2seq", Seq2Seq, _sentence, lambda out, y: out, lr=1e-3,
                   parts=lambda m: {"encoder": m.encoder, "decoder": m.decoder}, run=_translate, step_batch=False)

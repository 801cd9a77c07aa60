"""A copy task is no label leak.

An encoder-decoder taught to copy its source (tensor2tensor's ``algorithmic_identity``, the Annotated
Transformer's first example, curriculum copy tasks) has targets equal to its inputs, and its loss is the
one of copying them: ``label_leak`` said critical at step 0 of healthy runs. Its decoder is fed the targets
shifted right (teacher forcing), which a causal LM that sees its own targets is not: the data probe reads
the model's first call of a step, and a call holding the previous target tokens makes it a copy task.
The unshifted causal LM stays a critical leak (tests/test_precision.py).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread, quiet_probes

V, SOS, L = 12, 1, 8


class Seq2Seq(nn.Module):
    def __init__(self, h: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        self.pos = nn.Embedding(64, 32)
        self.enc = nn.GRU(32, h, batch_first=True)
        self.dec = nn.GRU(32, h, batch_first=True)
        self.out = nn.Linear(2 * h, V)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(src.size(1)))
        enc, h = self.enc(self.emb(src) + pos)
        dec, _ = self.dec(self.emb(tgt_in) + pos, h)
        att = torch.softmax(dec @ enc.transpose(1, 2) / enc.size(-1) ** 0.5, -1)
        return self.out(torch.cat([dec, att @ enc], -1))


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_an_encoder_decoder_copying_its_source_is_no_leak(tmp_path, level) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=quiet_probes())
    with one_thread(), diag:
        for _ in range(120):
            src = torch.randint(2, V, (32, L), generator=g)
            tgt_in = torch.cat([torch.full((32, 1), SOS), src[:, :-1]], 1)
            out = model(src, tgt_in)
            loss = F.cross_entropy(out.reshape(-1, V), src.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(src, src))
    assert loss.item() < 0.5  # it learned to copy
    assert not [a for a in diag.alerts if a.kind == "label_leak"], diag.alerts
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts

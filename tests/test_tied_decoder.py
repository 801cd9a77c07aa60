"""pytorch/examples' word_language_model recipe with ``--tied``: the decoder's weight is the embedding's, so the
decoder keeps only its bias, initialised to zero (``init_weights``); SGD at lr 20, ``clip_grad_norm_(0.25)``,
truncated BPTT (the hidden state detached between batches), the rate /4 every so often. Here on characters.

The decoder's "layer" is that bias alone, a size its own steps made: under SGD at lr 20 it is rewritten every step
(ratio 0.5-1.9) while the model learns. Before: ``update_ratio`` warned at ``extreme`` ("each step rewrites that
layer", step 10). A layer whose every parameter was zero when first measured is held to 10x the threshold
(``update/born_zero``); a rate 1000x too high on that bias is still said (by the loss it breaks).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _harness import local_session, one_thread
from trackdiag.core.record import read_records

TEXT = ("the quick brown fox jumps over the lazy dog. " * 40 + "pack my box with five dozen liquor jugs. " * 40) * 2
VOCAB = sorted(set(TEXT))


class CharLM(nn.Module):
    def __init__(self, d: int = 96) -> None:
        super().__init__()
        self.enc = nn.Embedding(len(VOCAB), d)
        self.rnn = nn.LSTM(d, d, 2, dropout=0.2, batch_first=True)
        self.drop = nn.Dropout(0.2)
        self.dec = nn.Linear(d, len(VOCAB))
        self.dec.weight = self.enc.weight  # --tied
        nn.init.uniform_(self.enc.weight, -0.1, 0.1)  # the example's init_weights
        nn.init.zeros_(self.dec.bias)

    def forward(self, x: torch.Tensor, h: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple]:
        out, h = self.rnn(self.drop(self.enc(x)), h)
        return self.dec(self.drop(out)), h


def train(out: Path, level: str, steps: int, bias_lr_factor: float = 1.0) -> tuple[list, list[float]]:
    torch.manual_seed(0)
    ids = torch.tensor([VOCAB.index(c) for c in TEXT])
    batch, bptt = 16, 35
    n = len(ids) // batch
    data = ids[: n * batch].view(batch, n)
    model = CharLM()
    bias = [model.dec.bias]
    rest = [p for p in model.parameters() if p is not model.dec.bias]
    opt = torch.optim.SGD([{"params": rest}, {"params": bias, "lr": 20 * bias_lr_factor}], lr=20)
    diag = local_session(model, opt, out, level)
    losses: list[float] = []
    h, pos = None, 0
    with one_thread(), diag:
        for step in range(steps):
            model.train()
            if pos + bptt + 1 > n:
                pos, h = 0, None
            x, y = data[:, pos:pos + bptt], data[:, pos + 1:pos + 1 + bptt]
            pos += bptt
            if h is not None:
                h = tuple(t.detach() for t in h)  # repackage_hidden
            logits, h = model(x, h)
            loss = F.cross_entropy(logits.reshape(-1, len(VOCAB)), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
            losses.append(loss.item())
            if step and step % 100 == 0:
                for g in opt.param_groups:
                    g["lr"] /= 4
    return diag.alerts, losses


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_tied_decoder_bias_rewritten_each_step_is_healthy(tmp_path, level: str) -> None:
    alerts, losses = train(tmp_path, level, 150)
    assert sum(losses[-10:]) / 10 < 0.25 * losses[0]  # it learns
    assert [(a.kind, a.step, a.where) for a in alerts if a.severity != "info"] == []
    if level == "extreme":  # measured at every logging step: the bias is born zero and rewritten every step
        recs = [r for r in read_records(tmp_path) if "diag/update/ratio/dec" in r.scalars]
        assert any(r.tables.get("diag/update/born_zero") == {"dec": 1.0} for r in recs)
        assert max(r.scalars["diag/update/ratio/dec"] for r in recs[1:12]) > 1.0  # what warned before


def test_a_rate_1000x_too_high_on_the_born_zero_bias_is_still_said(tmp_path) -> None:
    """Under SGD a born-zero layer's ratio does not move with its rate (its steps and the size they made scale
    together): a rate 1000x too high on the bias is said by what it does to the loss, as the learning rate."""
    alerts, _ = train(tmp_path, "extreme", 40, bias_lr_factor=1000.0)
    loud = [a for a in alerts if a.severity != "info"]
    assert loud and loud[0].kind in {"loss_divergence", "loss_spike", "grad_explosion"} and loud[0].step <= 10, \
        [(a.kind, a.severity, a.step, a.where) for a in alerts]
    assert "learning rate" in loud[0].hint.lower() or "learning rate" in loud[0].message.lower()

"""A silent error no issue named: padded sequence targets with the padding counted in the loss (``padding_in_loss``).

``F.cross_entropy(out.reshape(-1, V), y.reshape(-1))`` on targets padded with the pad id, ``ignore_index`` not set:
the model is trained to predict padding on a third of the positions, the real tokens' gradient is diluted and the
loss reads better than the model is (the padding is the easiest token). Before: silent.

Now ``padding_in_loss`` (warning) at the first measured step (0), at every preset, for a tagger (inputs padded at the
same positions) and a decoder fed the targets shifted right (padding one position later). The table's
``ce_unpadded`` equals ``F.cross_entropy(..., ignore_index=PAD)`` computed here, ``pad_share`` the padded share.
Healthy twins, silent: ``ignore_index=PAD``, a masked mean, targets set to -100 at padded positions, sequences of one
length (no padding), and a frequent class at random positions (an NER "O" tag: not a suffix, the inputs unpadded).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
V, T, B, PAD = 20, 16, 32, 0


def _batch(gen: torch.Generator, form: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lens = torch.full((B,), T) if form == "one_length" else torch.randint(4, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None] < lens[:, None]
    x = torch.randint(1, V, (B, T), generator=gen) * mask  # token ids 1..V-1, PAD = 0 after each length
    y = ((x * 3 + 1) % (V - 1) + 1) * mask  # a per-token map onto 1..V-1; padding stays PAD
    if form == "ner":  # tag 0 ("O") at random positions of unpadded inputs
        x, mask = torch.randint(1, V, (B, T), generator=gen), torch.ones(B, T, dtype=torch.bool)
        y = torch.where(torch.rand(B, T, generator=gen) < 0.7, 0, (x * 3 + 1) % (V - 1) + 1)
    if form == "decoder":  # fed the targets shifted right: a BOS, then y[:-1] (the padding one position later)
        x = torch.cat([torch.full((B, 1), V - 1), y[:, :-1]], 1)
    return x, y, mask


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.out = nn.Embedding(V, 32), nn.GRU(32, 64, batch_first=True), nn.Linear(64, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.emb(x))[0])


def _run(tmp_path, loss_form: str, data: str = "tagger", level: str = "advanced", steps: int = 30):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    first: dict[str, float] = {}
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        for step in range(steps):
            x, y, mask = _batch(gen, data)
            out = model(x)
            flat, tgt = out.reshape(-1, V), y.reshape(-1)
            if loss_form == "counted":
                loss = F.cross_entropy(flat, tgt)  # the fault: the padding counted
            elif loss_form == "ignore_index":
                loss = F.cross_entropy(flat, tgt, ignore_index=PAD)
            elif loss_form == "masked":
                loss = (F.cross_entropy(flat, tgt, reduction="none") * mask.reshape(-1)).sum() / mask.sum()
            else:  # "minus_100": padded targets set to -100, cross-entropy's default ignore_index
                y = y.masked_fill(~mask, -100)
                loss = F.cross_entropy(flat, y.reshape(-1))
            if step == 0:
                first = {"ce_unpadded": F.cross_entropy(flat.double(), tgt, ignore_index=PAD).item(),
                         "pad_share": (y == PAD).double().mean().item()}
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag, first


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("data", ["tagger", "decoder"])
def test_padding_counted_in_the_loss_is_found(tmp_path, level: str, data: str):
    diag, first = _run(tmp_path, "counted", data=data, level=level)
    found = [a for a in diag.alerts if a.kind == "padding_in_loss"]
    assert [(a.step, a.severity) for a in found] == [(0, "warning")], diag.alerts
    assert "ignore_index" in found[0].hint and "the padding included" in found[0].message
    table = next(r.tables["diag/data/loss_form"] for r in read_records(tmp_path) if "diag/data/loss_form" in r.tables)
    assert table["ce_unpadded"] == pytest.approx(first["ce_unpadded"], rel=1e-9)
    assert table["pad_share"] == pytest.approx(first["pad_share"], rel=1e-12)
    assert table["pad_suffix"] == 1.0 and table["pad_inputs"] == 1.0 and table["pad_value"] == PAD


@pytest.mark.parametrize("loss_form,data", [("ignore_index", "tagger"), ("masked", "tagger"), ("minus_100", "tagger"),
                                            ("ignore_index", "decoder"), ("counted", "one_length"), ("counted", "ner")])
def test_padding_left_out_or_absent_is_silent(tmp_path, loss_form: str, data: str):
    diag, _ = _run(tmp_path, loss_form, data=data)
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts

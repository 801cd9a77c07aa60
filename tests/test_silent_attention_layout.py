"""An attention layer fed its batch on the axis it takes as the sequence (``attention_batch_first``).

``nn.TransformerEncoderLayer(d, nhead)`` and ``nn.MultiheadAttention(d, nhead)`` take ``(sequence, batch, embedding)``
unless built with ``batch_first=True``; fed ``(batch, sequence, embedding)`` data with a mean read-out, every position
attends across the samples of the batch. Nothing crashes and the model learns something (a toy sequence classifier ends
at loss 0.89 instead of 0.63 after 60 steps). Before: silent.

Now ``attention_batch_first`` (warning) at the logging step after three judged steps (step 2 at ``advanced``), at every
preset, naming each attention layer, with the query's dims and the batch size in the table. Silent: ``batch_first=True``
on batch-major data, the default on sequence-major data, a sequence as long as the batch (ambiguous: not judged).
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
B, FEAT, D = 32, 8, 32


class Encoder(nn.Module):
    """A transformer encoder classifier, the way tutorials write it (``nn.TransformerEncoder`` of two layers)."""

    def __init__(self, batch_first: bool, sequence_major: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(FEAT, D)
        layer = nn.TransformerEncoderLayer(D, 4, 64, dropout=0.1, batch_first=batch_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head, self.sequence_major = nn.Linear(D, 3), sequence_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, sequence, features)
        h = self.embed(x)
        if self.sequence_major:
            return self.head(self.enc(h.transpose(0, 1)).mean(0))
        return self.head(self.enc(h).mean(1))


class Pooled(nn.Module):
    """``nn.MultiheadAttention`` used directly, self-attention then a mean."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(FEAT, D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=batch_first)
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.attn(h, h, h, need_weights=False)[0].mean(1))


def _run(tmp_path, model: nn.Module, level: str = "advanced", seq: int = 10, steps: int = 30):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        for _ in range(steps):
            x = torch.randn(B, seq, FEAT, generator=gen)
            y = (x[:, :, 0].mean(1) > 0).long() + (x[:, :, 1].mean(1) > 0).long()
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag


def _found(diag) -> list[tuple[str, str, str]]:
    return sorted((a.kind, a.severity, a.where) for a in diag.alerts if a.kind.endswith("batch_first"))


def _table(tmp_path) -> dict[str, float]:
    return {k: v for r in read_records(tmp_path) for k, v in r.tables.get("diag/model/attention_batch_axis", {}).items()}


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_transformer_encoder_fed_batch_major_data_is_named(tmp_path, level: str) -> None:
    diag = _run(tmp_path, Encoder(batch_first=False), level)
    assert _found(diag) == [("attention_batch_first", "warning", f"enc.layers.{i}.self_attn") for i in (0, 1)]
    first = min(a.step for a in diag.alerts if a.kind == "attention_batch_first")
    assert first <= (29 if level == "basic" else 2)  # three judged steps; basic says it at its next logging step (the close)
    table = _table(tmp_path)
    assert table["enc.layers.0.self_attn"] == 1.0 and table["enc.layers.0.self_attn/batch_first"] == 0.0
    assert (table["enc.layers.0.self_attn/dim0"], table["enc.layers.0.self_attn/dim1"]) == (B, 10)
    assert table["enc.layers.0.self_attn/batch"] == B


def test_multihead_attention_used_directly_is_named(tmp_path) -> None:
    diag = _run(tmp_path, Pooled(batch_first=False))
    assert _found(diag) == [("attention_batch_first", "warning", "attn")]
    alert = next(a for a in diag.alerts if a.kind == "attention_batch_first")
    assert "attends across the samples of the batch" in alert.message and "batch_first=True" in alert.hint


@pytest.mark.parametrize("model", ["batch_first", "sequence_major", "pooled_batch_first"])
def test_the_right_layout_is_judged_and_silent(tmp_path, model: str) -> None:
    built = {"batch_first": lambda: Encoder(batch_first=True), "sequence_major": lambda: Encoder(False, True),
             "pooled_batch_first": lambda: Pooled(batch_first=True)}[model]()
    diag = _run(tmp_path, built)
    assert _found(diag) == []
    table = _table(tmp_path)
    assert table and all(v == 0.0 for k, v in table.items() if "/" not in k)  # judged, and right


def test_a_sequence_as_long_as_the_batch_is_not_judged(tmp_path) -> None:
    diag = _run(tmp_path, Encoder(batch_first=False), seq=B)
    assert _found(diag) == [] and _table(tmp_path) == {}

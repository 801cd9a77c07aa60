"""A silent error no issue named: a recurrent layer fed its batch on the axis it takes as time (``rnn_batch_first``).

``nn.LSTM(F, H)`` (``batch_first=False``, the default) fed ``(batch, time, features)`` sequences, the classifier reading
``out[:, -1]``: the shapes line up, nothing crashes, and the recurrence runs across the samples of each batch. On a
toy sequence classifier the loss ends at 0.22 instead of 0.008. Before: silent.

Now ``rnn_batch_first`` (warning) at the logging step after three judged steps (step 2 at ``advanced``), at every
preset, naming the layer, for the LSTM, the GRU and the reverse (``batch_first=True`` fed time-major data). The table
holds the input's dims and the batch size read from the outputs. Healthy twins, silent: ``batch_first=True`` on
batch-major data, the default on time-major data (``x.transpose(0, 1)``), a sequence as long as the batch (ambiguous:
not judged), and a packed sequence.
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
B, FEAT = 32, 8


class Net(nn.Module):
    def __init__(self, cell: str, batch_first: bool, feed: str) -> None:
        super().__init__()
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell](FEAT, 32, batch_first=batch_first)
        self.out, self.feed = nn.Linear(32, 4), feed

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, time, features)
        if self.feed == "packed":
            lengths = torch.full((x.shape[0],), x.shape[1])
            packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
            _, h = self.rnn(packed)
            return self.out((h[0] if isinstance(h, tuple) else h)[-1])
        if self.feed == "time_major":
            x = x.transpose(0, 1)
        o, _ = self.rnn(x)
        return self.out(o[-1] if self.feed == "time_major" else o[:, -1])


def _run(tmp_path, cell="lstm", batch_first=False, feed="batch_major", level="advanced", time=12, steps=30):
    gen = torch.Generator().manual_seed(0)
    proto = torch.randn(4, FEAT, generator=gen)
    torch.manual_seed(0)
    model = Net(cell, batch_first, feed)
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        for _ in range(steps):
            y = torch.randint(0, 4, (B,), generator=gen)
            x = torch.randn(B, time, FEAT, generator=gen) * 0.5 + proto[y][:, None, :]
            if feed == "reverse":  # batch_first=True on data stored time-major
                x = x.transpose(0, 1)
                o, _ = model.rnn(x)
                out = model.out(o[-1])  # the user reads it as time-major: the last time step
            else:
                out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_batch_major_data_into_a_time_major_layer_is_found(tmp_path, level: str, cell: str):
    diag = _run(tmp_path, cell=cell, level=level)
    found = [a for a in diag.alerts if a.kind == "rnn_batch_first"]
    assert [(a.severity, a.where) for a in found] == [("warning", "rnn")], diag.alerts
    assert found[0].step <= (50 if level == "basic" else 10) and "batch_first=False" in found[0].message and "batch_first=True" in found[0].hint
    table = next(r.tables["diag/model/rnn_batch_axis"] for r in read_records(tmp_path) if "diag/model/rnn_batch_axis" in r.tables)
    assert table == {"rnn": 1.0, "rnn/batch_first": 0.0, "rnn/dim0": float(B), "rnn/dim1": 12.0, "rnn/batch": float(B)}


def test_time_major_data_into_a_batch_first_layer_is_found(tmp_path):
    diag = _run(tmp_path, batch_first=True, feed="reverse")
    found = [a for a in diag.alerts if a.kind == "rnn_batch_first"]
    assert [a.where for a in found] == ["rnn"] and "batch_first=True" in found[0].message, diag.alerts


@pytest.mark.parametrize("batch_first,feed,time", [(True, "batch_major", 12), (False, "time_major", 12),
                                                  (False, "batch_major", B), (False, "packed", 12)])
def test_layouts_that_match_or_cannot_be_told_are_silent(tmp_path, batch_first: bool, feed: str, time: int):
    diag = _run(tmp_path, batch_first=batch_first, feed=feed, time=time)
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts
    tables = [r.tables["diag/model/rnn_batch_axis"] for r in read_records(tmp_path) if "diag/model/rnn_batch_axis" in r.tables]
    if time == B or feed == "packed":
        assert tables == []  # the batch size on both axes, or no 3-D tensor: never judged
    else:
        assert tables and tables[0]["rnn"] == 0.0

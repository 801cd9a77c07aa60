"""Issue 45 item 6: data that does not change (``same_batch``, the ``data_repeat`` probe).

- ``next(iter(loader))`` inside the loop on an unshuffled DataLoader: the model sees the loader's first batch at
  every step. From step 0, and switched on at step 60 of a loop that iterated its loader until then.
- Healthy twins stay silent: the same loop iterating its loader (shuffled and not), full-batch training that
  passes the same tensors each step (a GCN-style loop with an evaluation after every step, and L-BFGS with a
  closure over the whole data set), and a loop whose held input is rewritten by nothing.
"""
from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trackdiag
from _zoo_a import digits, one_thread, quiet_probes


def _loud(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))


def _loader(shuffle: bool) -> DataLoader:
    xtr, ytr, _, _ = digits()
    return DataLoader(TensorDataset(xtr, ytr), batch_size=32, shuffle=shuffle, drop_last=True,
                      generator=torch.Generator().manual_seed(0))


def _endless(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from loader


def _train(tmp_path, mode: str, steps: int = 200, onset: int = 0, shuffle: bool = False) -> trackdiag.Diagnostics:
    """A classifier on digits. ``mode``: ``iterate`` (the loader's batches in turn) or ``restart``
    (``next(iter(loader))`` at every step from ``onset``)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = _loader(shuffle)
    it = _endless(loader)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=quiet_probes()) as diag:
        for step in range(steps):
            if mode == "restart" and step >= onset:
                x, y = next(iter(loader))  # the planted fault: a fresh iterator, its first batch, every step
            else:
                x, y = next(it)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
    return diag


def test_next_iter_in_loop_from_start(tmp_path):
    diag = _train(tmp_path, "restart")
    found = [a for a in _loud(diag) if a.kind == "same_batch"]
    assert found, [a.describe() for a in diag.alerts]
    assert found[0].step == 0 and found[0].severity == "warning"
    assert found[0].where == "input batch"
    raised = [r for r in diag.alerts if r.kind == "same_batch"][0]
    assert "consecutive steps from step 0" in raised.message
    assert len(found) == 1  # one episode, one alert


def test_next_iter_in_loop_from_step_60(tmp_path):
    diag = _train(tmp_path, "restart", onset=60)
    found = [a for a in _loud(diag) if a.kind == "same_batch"]
    assert found, [a.describe() for a in diag.alerts]
    assert 59 <= found[0].step <= 60 + 50  # the batch first seen at the onset (or the step before, if equal)
    # it was raised (its logging step) within 50 steps of the onset
    from trackdiag.core.record import read_records

    raised_at = [r.step for r in read_records(diag.summary()["output_dir"])
                 if any(a.kind == "same_batch" for a in r.alerts)]
    assert raised_at and raised_at[0] - 60 <= 50


def test_iterated_loader_is_silent(tmp_path):
    for shuffle in (False, True):
        diag = _train(tmp_path / str(shuffle), "iterate", shuffle=shuffle)
        assert not [a for a in diag.alerts if a.kind == "same_batch"], [a.describe() for a in diag.alerts]
        assert not _loud(diag), [a.describe() for a in _loud(diag)]


def test_full_batch_held_tensors_are_silent(tmp_path):
    """A GCN-style loop: the whole data set every step as the same tensors, targets cloned each step, an
    evaluation after every step; and L-BFGS with a closure over the whole data set."""
    xtr, ytr, xva, yva = digits()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=5e-4)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"],
                                             output_dir=str(tmp_path / "a"), probes=quiet_probes()) as diag:
        for _ in range(150):
            model.train()
            target = ytr.clone()
            logits = model(xtr)
            loss = F.cross_entropy(logits, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(xtr, target))
            model.eval()
            with torch.no_grad():
                diag.log_eval(loss=F.cross_entropy(model(xva), yva).item())
    assert not [a for a in diag.alerts if a.kind == "same_batch"]
    assert not _loud(diag), [a.describe() for a in _loud(diag)]

    model = _model()
    lbfgs = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=3, history_size=10, line_search_fn="strong_wolfe")
    with one_thread(), trackdiag.Diagnostics(model, lbfgs, level="advanced", sinks=["local"],
                                             output_dir=str(tmp_path / "b"), probes=quiet_probes()) as diag:
        for _ in range(60):
            def closure() -> torch.Tensor:
                lbfgs.zero_grad()
                loss = F.cross_entropy(model(xtr), ytr) + 1e-3 * sum(p.pow(2).sum() for p in model.parameters())
                loss.backward()
                return loss

            loss = lbfgs.step(closure)
            diag.step(loss, batch=(xtr, ytr))
    assert not [a for a in diag.alerts if a.kind == "same_batch"]


def test_probe_counts_rewritten_buffer_not_held_tensor(tmp_path):
    """The streak key itself: a held tensor counts 0; the same buffer refilled in place with the same batch
    counts every step (the version counter moved)."""
    from trackdiag.core.record import read_records

    xtr, ytr, _, _ = digits()
    for refill in (False, True):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        buf = xtr[:32].clone()
        out = tmp_path / str(refill)
        with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out),
                                                 probes=quiet_probes()) as diag:
            for _ in range(30):
                if refill:
                    buf.copy_(xtr[:32])
                loss = F.cross_entropy(model(buf), ytr[:32])
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, batch=(buf, ytr[:32]))
        streaks = [r.scalars["diag/data/repeat_streak"] for r in read_records(out)
                   if "diag/data/repeat_streak" in r.scalars]
        assert streaks and (max(streaks) >= 9 if refill else max(streaks) == 0), streaks

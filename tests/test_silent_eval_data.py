"""Issue 45 item 6: a validation set identical to a training batch (``log_eval(batch=...)``).

The evaluation batch handed to ``log_eval`` is fingerprinted like the training batches (the ``data_repeat``
probe) and compared with the last 1024 training steps' batches: the training loop's ``x, y`` reused inside the
evaluation block, or a validation loader built on the training split, is ``eval_on_train_batch`` (a warning)
at the evaluation that shows it. Held-out evaluation batches and full-batch training evaluated on its own
inputs (a graph's nodes under another mask) stay silent; ``log_eval(batch=<number>)`` is still a metric.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


PROTOS = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))


def _data(gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 4, (n,), generator=gen)
    return PROTOS[y] + 0.5 * torch.randn(n, 8, generator=gen), y


def _loop(tmp_path, plant: str | None, steps: int = 60) -> trackdiag.Diagnostics:
    """A shuffled minibatch loop, evaluated every 20 steps on one batch: held out, or (``plant``) the training
    loop's own batch (``reused``) or the first batch of the training split in loader order (``train_split``)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    xtr, ytr = _data(gen, 512)
    xva, yva = _data(gen, 64)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for step in range(steps):
            idx = torch.randperm(512, generator=gen)[:64] if step % 8 else torch.arange(64)  # epoch starts in order
            xb, yb = xtr[idx], ytr[idx]
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=None, batch=(xb, yb))
            if step % 20 == 19:
                xe, ye = {"reused": (xb, yb), "train_split": (xtr[:64], ytr[:64])}.get(plant or "", (xva, yva))
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xe), ye), batch=(xe, ye))
    return diag


def _warned(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


def test_eval_on_the_training_loops_batch_is_said_at_that_evaluation(tmp_path) -> None:
    diag = _loop(tmp_path, "reused")
    loud = _warned(diag)
    assert [a.kind for a in loud] == ["eval_on_train_batch"], [(a.kind, a.step, a.message) for a in diag.alerts]
    assert loud[0].severity == "warning" and loud[0].step == 19 and loud[0].value == 19.0
    assert "step 19" in loud[0].message


def test_validation_loader_on_the_training_split_is_said(tmp_path) -> None:
    diag = _loop(tmp_path, "train_split")
    loud = _warned(diag)
    assert [a.kind for a in loud] == ["eval_on_train_batch"], [(a.kind, a.step) for a in diag.alerts]
    assert loud[0].step == 19 and loud[0].value == 16.0  # the epoch that started at step 16 began with that batch


def test_held_out_evaluation_batch_is_silent(tmp_path) -> None:
    diag = _loop(tmp_path, None)
    assert _warned(diag) == [], [(a.kind, a.step, a.message) for a in _warned(diag)]
    assert any(a.kind == "eval_on_train_batch" for a in diag.alerts) is False


def test_full_batch_training_evaluated_on_its_own_inputs_is_silent(tmp_path) -> None:
    torch.manual_seed(0)
    x, y = _data(torch.Generator().manual_seed(1), 200)
    train, test = torch.arange(200) < 140, torch.arange(200) >= 140
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for step in range(40):
            out = model(x)
            loss = F.cross_entropy(out[train], y[train])
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=(x, y))
            if step % 10 == 9:
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(x)[test], y[test]), batch=(x, y))
    assert not [a for a in diag.alerts if a.kind == "eval_on_train_batch"], [(a.kind, a.step) for a in diag.alerts]


def test_a_metric_named_batch_is_still_a_metric(tmp_path) -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path), probes=OFF) as diag:
        loss = model(torch.ones(4, 2)).pow(2).mean()
        loss.backward()
        opt.step()
        diag.step(loss)
        diag.log_eval(loss=0.5, batch=3.0)
    from trackdiag.core.record import read_records
    evals = [r.scalars for r in read_records(tmp_path) if "diag/eval/loss" in r.scalars]
    assert evals and evals[0]["diag/eval/batch"] == 3.0

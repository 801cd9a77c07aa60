"""A silent error no issue named: the validation pass run with the model in training mode (``eval_train_mode``).

``with torch.no_grad(): val = loss_fn(model(x_val), y_val)`` with no ``model.eval()`` before it: dropout stays on and
BatchNorm normalises with the validation batch's statistics and folds them into its running ones. Nothing crashes; the
validation loss is noisy and worse than the model's, and the model has seen the validation data.

Before: silent. Now ``eval_train_mode`` (warning) at the second ``log_eval`` (the watch starts at the first), naming
the dropout and BatchNorm layers, at every preset; ``diag/model/eval_train_calls`` equals the number of validation
calls. Healthy twins, silent: ``model.eval()`` / ``model.train()`` around the validation pass, a model without dropout
or BatchNorm evaluated in training mode (the mode changes nothing), a GAN-style no-grad forward inside the training
step, and ``log_eval`` called after ``model.train()`` was restored.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from conftest import batches
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


def _model(kind: str) -> nn.Module:
    if kind == "plain":
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def _run(tmp_path, digits, *, model: str = "bn_dropout", eval_mode: bool = False, level: str = "advanced",
         nograd_in_step: bool = False, steps: int = 100, every: int = 20, chunks: int = 2):
    x, y = digits
    torch.manual_seed(0)
    net = _model(model)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xv, yv = x[1400:], y[1400:]
    with one_thread(), trackdiag.Diagnostics(net, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        data = batches(x[:1400], y[:1400])
        for step in range(steps):
            xb, yb = next(data)
            if nograd_in_step:  # a GAN's fake batch or an RL rollout: a no-grad call inside the training step
                with torch.no_grad():
                    net(xb)
            out = net(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
            if (step + 1) % every == 0:
                if eval_mode:
                    net.eval()
                with torch.no_grad():
                    val = sum(F.cross_entropy(net(xc), yc).item() for xc, yc in zip(xv.chunk(chunks), yv.chunk(chunks)))
                net.train()
                diag.log_eval(loss=val / chunks)
    return diag


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_a_validation_pass_in_training_mode_is_found(tmp_path, digits, level: str) -> None:
    diag = _run(tmp_path, digits, level=level, chunks=3)
    found = [a for a in diag.alerts if a.kind == "eval_train_mode"]
    assert [(a.step, a.severity) for a in found] == [(39, "warning")], diag.alerts  # the second evaluation's step
    assert "dropout was on in 3" in found[0].message and "BatchNorm" in found[0].message and "in 1" in found[0].message
    assert "3 time(s)" in found[0].message and "model.eval()" in found[0].hint
    evals = [r for r in read_records(tmp_path) if "diag/eval/loss" in r.scalars]
    calls = [r.scalars.get("diag/model/eval_train_calls") for r in evals]
    assert calls == [None] + [3.0] * (len(evals) - 1), calls  # every watched evaluation: its 3 calls
    assert evals[1].tables["diag/model/eval_train_modules"] == {"1": 2.0, "3": 1.0}


@pytest.mark.parametrize("case", ["eval_mode", "no_dropout_or_bn", "nograd_inside_the_step"])
def test_healthy_evaluations_are_silent(tmp_path, digits, case: str) -> None:
    """Evaluated in eval mode (also with a no-grad call inside each training step), or a model without dropout and
    BatchNorm evaluated in training mode: its calls are counted, and nothing depends on the mode."""
    diag = _run(tmp_path, digits, eval_mode=case != "no_dropout_or_bn", model="plain" if case == "no_dropout_or_bn"
                else "bn_dropout", nograd_in_step=case == "nograd_inside_the_step")
    assert not [a for a in diag.alerts if a.kind == "eval_train_mode"], diag.alerts
    evals = [r for r in read_records(tmp_path) if "diag/eval/loss" in r.scalars]
    calls = [r.scalars.get("diag/model/eval_train_calls") for r in evals]
    assert len(evals) == 5 and not any("diag/model/eval_train_modules" in r.tables for r in evals)
    assert calls == ([None] + [2.0] * 4 if case == "no_dropout_or_bn" else [None] * 5), calls

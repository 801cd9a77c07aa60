"""Issue 45 item 8: evaluation that disagrees with training (``eval_mismatch``, ``eval_frozen``).

A digits classifier evaluated every 20 steps on the held-out split, with one planted fault each:
- the evaluation sums the loss over the split (``reduction='sum'``) while training takes the mean: ~360x;
- from step 100 the evaluation runs on a freshly initialised model (``load_state_dict`` forgotten);
- the evaluation runs on a copy of the model made before training and never synced (the loss is the same
  number at every evaluation);
- the logged validation loss is a variable set once before the loop (the accuracy is recomputed).
The healthy twin (the same loop, the evaluation right) raises nothing of warning or worse, and a loop that
sums its train loss over the batch while evaluating per sample (PyTorch's VAE example) gets ``info`` at most.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread, quiet_probes


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 10))


def _run(tmp_path, fault: str | None, steps: int = 240) -> trackdiag.Diagnostics:
    xtr, ytr, xva, yva = digits()
    model = _model()
    frozen_copy = copy.deepcopy(model)  # the "eval model" of the stale-copy fault
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    val_loss = float("nan")
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=quiet_probes()) as diag:
        if fault == "stale_variable":
            with torch.no_grad():
                val_loss = F.cross_entropy(model(xva), yva).item()  # computed once, logged forever
        for step in range(steps):
            idx = torch.randint(0, len(xtr), (32,), generator=gen)
            x, y = xtr[idx], ytr[idx]
            model.train()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
            if step % 20 == 19:
                evaluated = model
                if fault == "stale_copy":
                    evaluated = frozen_copy
                elif fault == "fresh_from_100" and step >= 100:
                    evaluated = _model(seed=step)  # the checkpoint's weights never loaded into it
                evaluated.eval()
                with torch.no_grad():
                    out = evaluated(xva)
                    acc = (out.argmax(1) == yva).float().mean().item()
                    if fault == "sum":
                        val = F.cross_entropy(out, yva, reduction="sum").item()
                    elif fault == "stale_variable":
                        val = val_loss
                    else:
                        val = F.cross_entropy(out, yva).item()
                diag.log_eval(loss=val, accuracy=acc)
    return diag


def _loud(diag: trackdiag.Diagnostics, kind: str) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.kind == kind and a.severity != "info"]


def test_sum_reduced_eval(tmp_path):
    diag = _run(tmp_path, "sum")
    found = _loud(diag, "eval_mismatch")
    assert found, [a.describe() for a in diag.alerts]
    assert found[0].step == 19 and found[0].severity == "warning" and found[0].where == "eval/loss"
    assert found[0].value >= 30 and "every evaluation since the first" in found[0].message
    assert "reduction" in found[0].hint and "model.eval()" in found[0].hint


def test_fresh_model_evaluated_from_step_100(tmp_path):
    diag = _run(tmp_path, "fresh_from_100")
    found = _loud(diag, "eval_mismatch")
    assert found, [a.describe() for a in diag.alerts]
    assert found[0].step == 119 and found[0].step - 100 <= 50  # the first evaluation of the fresh model
    assert "jumped" in found[0].message


def test_stale_model_copy(tmp_path):
    diag = _run(tmp_path, "stale_copy")
    found = _loud(diag, "eval_frozen")
    assert found, [a.describe() for a in diag.alerts]
    assert found[0].step == 19 and found[0].where in ("eval/loss", "eval/accuracy")
    assert {a.where for a in found} == {"eval/loss", "eval/accuracy"}  # both never move


def test_stale_variable(tmp_path):
    diag = _run(tmp_path, "stale_variable")
    found = _loud(diag, "eval_frozen")
    assert [a.where for a in found] == ["eval/loss"], [a.describe() for a in diag.alerts]
    assert found[0].step == 19


def test_healthy_eval_is_silent(tmp_path):
    diag = _run(tmp_path, None)
    loud = [a for a in diag.alerts if a.severity != "info"]
    assert not loud, [a.describe() for a in loud]
    assert not [a for a in diag.alerts if a.kind in ("eval_mismatch", "eval_frozen")]


def test_batch_summed_train_loss_is_info(tmp_path):
    """Train loss summed over batches of 64, evaluation per sample: a convention, said at info."""
    xtr, ytr, xva, yva = digits()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=quiet_probes()) as diag:
        for step in range(120):
            idx = torch.randint(0, len(xtr), (64,), generator=gen)
            logits = model(xtr[idx])
            loss = F.cross_entropy(logits, ytr[idx], reduction="sum")
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(xtr[idx], ytr[idx]))
            if step % 20 == 19:
                model.eval()
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xva), yva).item())
                model.train()
    found = [a for a in diag.alerts if a.kind == "eval_mismatch"]
    assert found and all(a.severity == "info" for a in found), [a.describe() for a in diag.alerts]
    assert "summed over the batch" in found[0].message


def test_a_learning_rate_blown_up_is_not_an_evaluation_mismatch(tmp_path) -> None:
    """A loop that evaluates every step (the corpus's full-batch GCN) sees LR x1000 in the evaluation one step before
    the train loss: the evaluation 'jumped while the train loss held' only until the train losses of the next logging
    step arrive. The first alert is the gradient's (it was eval_mismatch at the onset, with a misleading hint)."""
    from _styles import load

    run = load("full_batch").run(tmp_path, level="advanced", seed=0, steps=100, fault="lr1000", onset=40)
    first = run.first("warning")
    assert first is not None and first.kind != "eval_mismatch", first
    assert [a for a in run.diag.alerts if a.kind == "eval_mismatch"] == []

"""A silent error no issue named: the validation split not prepared as the training split (``eval_input_shift``).

Features standardised with the training split's mean and std (a ``StandardScaler``, a ``Normalize``) and the
validation split left raw, or given only part of it (``/ 16``): the model is evaluated on inputs on another scale. The
validation loss is high from the first evaluation and climbs as the model sharpens, which the previous build
reported as ``overfitting`` (step 99 on the digits MLP), a wrong cause with the wrong remedies (regularise).

Now ``eval_input_shift`` (warning) at the second ``log_eval`` (the watch starts at the first), at every preset, and
``overfitting`` says nothing for such a run. ``diag/data/eval_input_scale`` and ``eval_input_offset`` equal the
per-feature statistics computed here, in float64, over the same calls. Healthy twins, silent: both splits
standardised alike, mixup in training (a narrower training spread), Gaussian input noise in training, evaluation in
several chunks, a no-grad call inside each training step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from trackdiag.core.record import read_records
from trackdiag.probes.eval_inputs import EVAL_CALLS, TRAIN_CALLS

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
EVERY = 20


def _split(digits):
    x, y = digits
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=gen)
    xtr, ytr, xva, yva = x[perm[:1400]], y[perm[:1400]], x[perm[1400:]], y[perm[1400:]]
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    return (xtr - mu) / sd, ytr, xva, yva, mu, sd


def _run(tmp_path, digits, *, val: str = "standardised", level: str = "advanced", steps: int = 140,
         train_aug: str = "", chunks: int = 1, nograd_in_step: bool = False, probes: dict | None = None):
    """The digits MLP; returns the session and the training batches of the steps the probe samples."""
    xtr, ytr, xva, yva, mu, sd = _split(digits)
    xva = {"standardised": (xva - mu) / sd, "raw": xva * 16.0, "divided": xva,  # digits holds x / 16
           "offset": (xva - mu) / sd + 3.0}[val]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    sampled: list[torch.Tensor] = []
    evals: list[torch.Tensor] = []
    first_eval = EVERY - 1
    with one_thread(), trackdiag.Diagnostics(net, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF if probes is None else probes, budget=None) as diag:
        for step in range(steps):
            idx = torch.randint(0, len(xtr), (64,), generator=gen)
            xb, yb = xtr[idx], ytr[idx]
            if train_aug == "mixup":
                lam = 0.5
                xb = lam * xb + (1 - lam) * xb.flip(0)
            elif train_aug == "noise":
                xb = xb + torch.randn(xb.shape, generator=gen)
            if nograd_in_step:
                with torch.no_grad():
                    net(xb[:8] * 100)  # a no-grad call inside the step: not an evaluation
            if step > first_eval and (step - first_eval - 1) % EVERY < TRAIN_CALLS:
                sampled.append(xb)
            out = net(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
            if (step + 1) % EVERY == 0:
                net.eval()
                with torch.no_grad():
                    val_loss = sum(F.cross_entropy(net(xc), yc).item() for xc, yc in zip(xva.chunk(chunks), yva.chunk(chunks)))
                net.train()
                if step == 2 * EVERY - 1:
                    evals = list(xva.chunk(chunks))[:EVAL_CALLS]
                diag.log_eval(loss=val_loss / chunks)
    return diag, sampled, evals


def _reference(train: list[torch.Tensor], evals: list[torch.Tensor]) -> tuple[float, float]:
    t, e = torch.cat(train).double().numpy(), torch.cat(evals).double().numpy()
    mt, st, me, se = t.mean(0), t.std(0), e.mean(0), e.std(0)
    live = st > 1e-6 * st.max()
    return float(np.median(se[live] / st[live])), float(np.median(np.abs(me[live] - mt[live]) / st[live]))


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("val", ["raw", "divided"])
def test_a_validation_split_left_unnormalised_is_found_not_called_overfitting(tmp_path, digits, level: str, val: str):
    diag, sampled, evals = _run(tmp_path, digits, val=val, level=level)
    found = [a for a in diag.alerts if a.kind == "eval_input_shift"]
    assert [(a.step, a.severity) for a in found] == [(2 * EVERY - 1, "warning")], diag.alerts
    assert not [a for a in diag.alerts if a.kind == "overfitting"], diag.alerts
    assert "not prepared as the training data" in found[0].message and "Normalize" in found[0].hint
    record = next(r for r in read_records(tmp_path) if r.step == 2 * EVERY - 1 and "diag/eval/loss" in r.scalars)
    scale, offset = _reference(sampled[:TRAIN_CALLS], evals)
    assert record.scalars["diag/data/eval_input_scale"] == pytest.approx(scale, rel=1e-4)
    assert record.scalars["diag/data/eval_input_offset"] == pytest.approx(offset, rel=1e-4, abs=1e-6)
    assert (scale > 2.5) if val == "raw" else (scale < 0.4), scale


def test_means_moved_on_the_same_spread_are_info_only(tmp_path, digits):
    """The same spread, means 3 training standard deviations away: as likely a distribution that moved (a series with a
    trend split by time) as a bug; said as info, and the validation loss is still judged."""
    diag, sampled, evals = _run(tmp_path, digits, val="offset")
    found = [a for a in diag.alerts if a.kind == "eval_input_shift"]
    assert [(a.step, a.severity) for a in found] == [(2 * EVERY - 1, "info")], diag.alerts
    assert "another distribution" in found[0].message
    scale, offset = _reference(sampled[:TRAIN_CALLS], evals)
    assert 0.6 < scale < 1.5 and offset > 2.0 and found[0].value == pytest.approx(offset, rel=1e-4)


def test_without_the_probe_the_same_run_reads_as_overfitting(tmp_path, digits):
    """What the previous build told the user: with the ``eval_inputs`` probe off, the same run is ``overfitting``."""
    diag, _, _ = _run(tmp_path, digits, val="raw", probes={**OFF, "eval_inputs": {"enabled": False}})
    assert [a.kind for a in diag.alerts if a.severity != "info"] == ["overfitting"], diag.alerts


@pytest.mark.parametrize("case", ["standardised", "mixup", "noise", "chunks", "nograd_inside_the_step"])
def test_healthy_evaluations_are_silent(tmp_path, digits, case: str):
    diag, sampled, evals = _run(tmp_path, digits, train_aug=case if case in ("mixup", "noise") else "",
                                chunks=4 if case == "chunks" else 1, nograd_in_step=case == "nograd_inside_the_step")
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts
    record = next(r for r in read_records(tmp_path) if r.step == 2 * EVERY - 1 and "diag/eval/loss" in r.scalars)
    scale, offset = _reference(sampled[:TRAIN_CALLS], evals)
    assert record.scalars["diag/data/eval_input_scale"] == pytest.approx(scale, rel=1e-4)
    assert 0.6 < scale < 1.5 and offset < 0.5, (scale, offset)


def test_a_policy_told_its_objective_is_not_judged(tmp_path, digits):
    """``objective="rl"``: a policy evaluated greedily visits a narrower set of states than it trained on; the same
    unnormalised evaluation is measured but not judged."""
    xtr, ytr, xva, _, _, _ = _split(digits)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    with one_thread(), trackdiag.Diagnostics(net, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None, objective="rl") as diag:
        for step in range(60):
            out = net(xtr[step * 16:(step + 1) * 16])
            loss = -(out.log_softmax(1)[:, 0] * torch.randn(16)).sum()  # a policy-gradient shape
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
            if (step + 1) % EVERY == 0:
                net.eval()
                with torch.no_grad():
                    net(xva * 16)
                net.train()
                diag.log_eval(reward=1.0)
    scales = [r.scalars["diag/data/eval_input_scale"] for r in read_records(tmp_path) if "diag/data/eval_input_scale" in r.scalars]
    assert scales and min(scales) > 2.5  # measured
    assert not [a for a in diag.alerts if a.kind == "eval_input_shift"], diag.alerts


@pytest.mark.parametrize("shape,dtype", [((16, 3, 8, 8), torch.float32), ((64, 12), torch.bfloat16), ((50,), torch.float64),
                                         ((4, 5000), torch.float32)])
def test_feature_moments_equal_sums_taken_another_way(shape, dtype):
    """Per feature (dim 1; one feature for 1-D inputs or over 4096 features): the sums of the values and of their
    squares, against float64 sums over the feature's values gathered by a transpose."""
    from trackdiag.probes.eval_inputs import MAX_FEATURES, feature_moments

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 3).to(dtype)
    sums, rows = feature_moments(x)
    v = x.double()
    cols = v.reshape(-1, 1) if v.dim() == 1 or v.shape[1] > MAX_FEATURES else v.transpose(0, 1).reshape(v.shape[1], -1).T
    assert rows == cols.shape[0]
    torch.testing.assert_close(sums[0].double(), cols.sum(0), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(sums[1].double(), (cols * cols).sum(0), rtol=1e-5, atol=1e-3)

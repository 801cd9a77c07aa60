"""Crash forensics with what was held (issue 45 item 7): when a run dies, the ``crash`` finding leads with the
strongest evidence the session held or saw in the steps before (update_ratio's held out-of-scale update, a
learning-rate jump, a gradient-norm explosion, a loss spike), then the module; the hint says lower the LR
when the weights blew up. A crash without such evidence keeps its wording. Real loops, a real local record. The
finding names the line of the training script that raised (the traceback's), not the `with diag:` line its frame is
closing when the finding is made; autograd's in-place error gets the forward line that made the tensor (a replay
under anomaly detection), and errors whose traceback hides the cause (a hidden state carried without detach, a forward
under no_grad, BatchNorm given one sample) get their remedy."""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.core.record import Record
from trackdiag.forensics import crash_evidence
from trackdiag.util import exit_status

import _zoo_crash as zoo
from _zoo_b import digits


@pytest.fixture(autouse=True)
def _fresh_exit_status():
    exit_status._reset_for_tests()
    yield
    exit_status._reset_for_tests()


class VAE(nn.Module):
    """The PyTorch VAE example's shape (digits: 64 -> 8 latent dims), BCE on a sigmoid output."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
        self.dec = nn.Sequential(nn.Linear(8, 48), nn.ReLU(), nn.Linear(48, 64), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def vae(level: str, out: Path, jump_at: int | None = None, raise_at: int | None = None, steps: int = 80) -> list[Any]:
    """Adam at 1e-2; at ``jump_at`` the loop multiplies the LR by 1000 (one optimizer step at 10): the next
    forward's ``exp(0.5 * logvar)`` overflows and ``binary_cross_entropy`` raises. ``raise_at``: a plain bug
    (ValueError) at that step instead. Returns the session's alerts."""
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    diag = trackdiag.Diagnostics(model, opt, level=level, every=10, sinks=["local"], output_dir=str(out),
                                 probes={"report": {"enabled": False}})
    x_all = digits()[0]
    try:
        with zoo.one_thread(), diag:
            for step in range(steps):
                if step == jump_at:
                    for g in opt.param_groups:
                        g["lr"] *= 1000
                if step == raise_at:
                    raise ValueError(f"bad sample id {step} in the manifest")
                x = x_all[step * 32 % 1500:][:32]
                recon, mu, logvar = model(x)
                bce = F.binary_cross_entropy(recon, x, reduction="sum") / len(x)
                kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
                loss = bce + kld
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, batch=x)
    except (RuntimeError, ValueError) as exc:
        return [diag.alerts, exc]
    raise AssertionError("the loop was meant to crash")


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_a_crash_after_an_out_of_scale_update_leads_with_it(tmp_path, level):
    """LR x1000 at step 50 (an update-ratio measurement: every 50 at advanced, 10 at extreme): BCE raises at 51."""
    alerts, exc = vae(level, tmp_path, jump_at=50)
    assert "between 0 and 1" in str(exc)
    crash = alerts[-1]
    assert (crash.kind, crash.step) == ("crash", 51)
    assert crash.message.startswith("Before the crash, an out-of-scale update at step 50: one optimizer step moved "
                                    "the weights by "), crash.message
    ratio = float(crash.message.split("moved the weights by ")[1].split("x")[0])
    assert ratio > 1, crash.message  # above update_ratio's ``high``: Adam at lr 10 moves every weight by ~10
    assert "update_ratio was holding it for confirmation" in crash.message
    assert "a learning-rate jump: the learning rate rose 1e+03x (0.01 at step 40 -> 10 logged at step 50)" in crash.message
    # then the exception and the module, as before
    assert crash.message.index("The run stopped at step 51: RuntimeError") > crash.message.index("learning-rate jump")
    assert crash.where.startswith("dec.0 (Linear"), crash.where  # the module whose input was non-finite
    assert "lower the learning rate" in crash.hint and "one optimizer step at step 50" in crash.hint
    assert "dec.0 (Linear" in crash.hint and "log/div/sqrt" not in crash.hint, crash.hint
    stored = json.loads((tmp_path / "alerts.json").read_text())[-1]
    assert stored["kind"] == "crash" and stored["message"] == crash.message


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_learning_rate_jump_between_logging_steps_leads_when_nothing_measured_the_update(tmp_path, level):
    """LR x1000 at step 43 (no update measurement; the LR last logged at 40): the LR read at the crash says it."""
    alerts, _ = vae(level, tmp_path, jump_at=43)
    crash = alerts[-1]
    assert (crash.kind, crash.step) == ("crash", 44)
    assert crash.message.startswith("Before the crash, a learning-rate jump: the learning rate rose 1e+03x (0.01 at "
                                    "step 40 -> 10 read at the crash)."), crash.message
    assert "out-of-scale update" not in crash.message
    assert crash.hint.startswith("The weights blew up before the crash (the learning rate jumped): lower the learning rate")


def _old_wording(crash: Any) -> None:
    assert crash.message.startswith(f"The run stopped at step {crash.step}: "), crash.message
    assert "Before the crash" not in crash.message and "blew up" not in crash.hint


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_plain_bug_gets_no_invented_evidence(tmp_path, level):
    alerts, _ = vae(level, tmp_path, raise_at=37)
    (crash,) = [a for a in alerts if a.kind == "crash"]
    assert crash.step == 37 and "ValueError: bad sample id 37" in crash.message
    _old_wording(crash)
    assert crash.hint.startswith("Not a non-finite fault")


def test_a_nan_from_log0_in_a_healthy_module_keeps_its_wording(tmp_path, monkeypatch):
    """tests/_zoo_crash.py's VAE: dec.2 computes log(0) from step 12, the weights are healthy."""
    made: list[Any] = []
    real = trackdiag.Diagnostics.__init__
    monkeypatch.setattr(trackdiag.Diagnostics, "__init__", lambda self, *a, **k: (real(self, *a, **k), made.append(self))[0])
    with pytest.raises(RuntimeError):
        zoo.vae("advanced", tmp_path, onset=12)
    (crash,) = made[0].alerts
    _old_wording(crash)
    assert crash.where.startswith("dec.2 (NanGate, input finite)") and "guard the log/div/sqrt/exp" in crash.hint


def _records(lrs: list[tuple[int, float]]) -> list[Record]:
    return [Record(step=s, time=0.0, scalars={"diag/opt/lr": v}) for s, v in lrs]


def test_schedules_are_no_learning_rate_jump():
    """A linear warm-up logged every 10 steps, a cosine restart back to its top: no jump; 1000x: one."""
    warm = _records([(s, 1e-3 * (s + 1) / 500) for s in range(0, 60, 10)])
    assert crash_evidence.lr_jumps(warm, {"diag/opt/lr": 1e-3 * 61 / 500}, 61, 10) == []
    cosine = [(s, 1e-3 * 0.5 * (1 + math.cos(math.pi * (s % 100) / 100)) + 1e-6) for s in range(0, 210, 10)]
    assert crash_evidence.lr_jumps(_records(cosine), {"diag/opt/lr": 1e-3}, 201, 10) == []
    (jump,) = crash_evidence.lr_jumps(_records(cosine), {"diag/opt/lr": 1.0}, 205, 10)
    assert jump.rank == crash_evidence.LR and jump.step == 205 and "read at the crash" in jump.text


def test_series_evidence_and_its_order():
    """A gradient norm 50x its median, a loss 4x its median: both found; the lead is the stronger (gradient)."""
    grad = [(s, 1.0 + 0.1 * (s % 3)) for s in range(10)] + [(10, 55.0)]
    loss = [(s, 2.0 - 0.01 * s) for s in range(10)] + [(10, 8.0)]
    ev = crash_evidence.series({"diag/grad/global_norm": grad, "diag/loss": loss})
    assert sorted(e.rank for e in ev) == [crash_evidence.GRAD, crash_evidence.LOSS]
    lead = crash_evidence.lead(ev)
    assert lead.startswith("Before the crash, a gradient-norm explosion at step 10") and "a loss spike at step 10" in lead
    noisy = [(s, 1.0 + (s % 4)) for s in range(11)]  # 1-4x its level: an RL-like noisy norm is no evidence
    assert crash_evidence.series({"diag/grad/global_norm": noisy, "diag/loss": noisy}) == []


class _InplaceAfter(nn.Module):
    """``h += 1`` on a sigmoid's output from ``at`` on: autograd raises in ``backward()`` ("modified by an inplace
    operation"), a crash whose line is the loop's ``backward()``."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.l1, self.l2, self.at, self.step = nn.Linear(16, 32), nn.Linear(32, 4), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.l1(x))
        if self.step >= self.at:
            h += 1.0
        return self.l2(h)


def test_the_crash_names_the_line_that_raised_not_the_with_block(tmp_path):
    """The training script's frame is still running (its ``with diag:`` block is closing) when the finding is made:
    its current line is the ``with`` line; the line the traceback holds is the one that raised."""
    import inspect

    model = _InplaceAfter(at=12)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="inplace operation"):
        with trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path)) as diag:
            for step in range(30):
                model.step = step
                x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()  # raises at step 12
                opt.step()
                diag.step(loss, batch=(x, y))
    (crash,) = [a for a in diag.alerts if a.kind == "crash"]
    source, start = inspect.getsourcelines(test_the_crash_names_the_line_that_raised_not_the_with_block)
    line = start + next(i for i, s in enumerate(source) if "raises at step 12" in s)
    assert crash.step == 12
    assert f"Last line of the training script: test_crash_evidence.py:{line} in " in crash.message, crash.message


class _Block(nn.Module):
    """A block whose forward changes a saved tensor in place from ``at`` on (a residual written ``h += x``)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.fc, self.at, self.step = nn.Linear(32, 32), at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if self.step >= self.at:
            h += x  # tanh saved its output for backward
        return h


def _inplace_crash(tmp_path, level: str):
    block = _Block(at=12)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), block, nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    stats = None
    with pytest.raises(RuntimeError, match="inplace operation"):
        with trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path)) as diag:
            for step in range(30):
                block.step = step
                x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
                loss = F.cross_entropy(model(x), y)
                stats = model[1].running_mean.clone()
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss, batch=(x, y))
    (crash,) = [a for a in diag.alerts if a.kind == "crash"]
    return crash, model, stats


def test_an_inplace_autograd_crash_names_the_forward_line_that_made_the_tensor(tmp_path):
    import inspect

    crash, model, stats = _inplace_crash(tmp_path, "advanced")
    source, start = inspect.getsourcelines(_Block.forward)
    line = start + next(i for i, s in enumerate(source) if "torch.tanh" in s)
    assert crash.step == 12
    assert (f"Replayed under anomaly detection: the tensor changed in place was made at test_crash_evidence.py:{line} "
            f"in forward of 2 (_Block): `h = torch.tanh(self.fc(x))`") in crash.message, crash.message
    assert crash.where == f"2 (_Block), test_crash_evidence.py:{line}"
    assert crash.hint.startswith("A tensor autograd saved for the backward pass was changed in place")
    assert torch.equal(model[1].running_mean, stats)  # the replay's forward left BatchNorm's statistics alone


def test_an_inplace_autograd_crash_at_basic_gets_the_remedy_not_a_nan_hint(tmp_path):
    crash, _, _ = _inplace_crash(tmp_path, "basic")  # no NaN replay at basic: nothing replayed
    assert "Replayed under anomaly detection" not in crash.message
    assert crash.hint.startswith("A tensor autograd saved for the backward pass was changed in place")
    assert "non-finite" not in crash.hint


@pytest.mark.parametrize("text,about", [
    ("Loss is nan, stopping training", True), ("Function 'LogBackward0' returned nan values in its 0th output.", True),
    ("value is inf", True), ("Expected parameter loc to satisfy the constraint Real()", True),
    ("...with torch.autograd.set_detect_anomaly(True, check_nan=False).", False),
    ("see the documentation for more information", False), ("shape mismatch at inference", False),
])
def test_what_counts_as_an_exception_about_non_finite_values(text, about):
    from trackdiag.forensics.crash import nonfinite_text

    assert nonfinite_text(RuntimeError(text)) is about


def _crashing_loop(tmp_path, kind: str, at: int = 5):
    """A small loop that dies at step ``at`` with one of the errors whose traceback does not say the cause:
    ``carried`` (a GRU's hidden state carried across batches without ``detach``), ``no_grad`` (the forward left
    under ``torch.no_grad()``), ``bn_one`` (a BatchNorm layer given a last batch of one sample)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    if kind == "carried":
        model = nn.GRU(8, 16, batch_first=True)
    else:
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    h = None
    with pytest.raises((RuntimeError, ValueError)) as raised:
        with trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path)) as diag:
            for step in range(20):
                if kind == "carried":
                    x = torch.randn(4, 6, 8, generator=gen)
                    out, h = model(x, h)  # h from the step before, still attached to its graph
                    loss = out.pow(2).mean()
                else:
                    x = torch.randn(1 if kind == "bn_one" and step == at else 32, 8, generator=gen)
                    y = torch.randint(0, 4, (len(x),), generator=gen)
                    with torch.no_grad() if kind == "no_grad" and step == at else contextlib.nullcontext():
                        loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                diag.step(loss)
    (crash,) = [a for a in diag.alerts if a.kind == "crash"]
    return crash, raised.value


@pytest.mark.parametrize("kind,step,hint", [
    ("carried", 1, "carried from one batch to the next without .detach()"),
    ("no_grad", 5, "the forward ran under torch.no_grad()"),
    ("bn_one", 5, "A BatchNorm layer got a batch of one sample"),
])
def test_errors_whose_traceback_hides_the_cause_get_their_remedy(tmp_path, kind, step, hint):
    crash, exc = _crashing_loop(tmp_path, kind)
    assert crash.step == step and type(exc).__name__ in crash.message
    assert hint in crash.hint, crash.hint
    assert not crash.hint.startswith("Not a non-finite fault")

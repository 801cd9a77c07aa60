"""Issue 45 item 2: a minimised loss falling without bound is said as a loss problem, at once (``loss_runaway``).

The planted fault is the issue's: a VAE (the PyTorch example's, per-batch summed loss) whose KL term flips
sign, from step 0 and from a step mid-run (a KL weight annealed below zero). Before, the loss went from
thousands to -1e9 and the only alerts came much later (gradients). The healthy twins: the same VAE with
its KL added, and a normalizing flow whose NLL starts positive and converges below zero (legitimately
negative), and a loss handed as a dict of parts with a negative log-likelihood part: none raises it.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread
from trackdiag.rules.runaway import LossRunaway

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc21, self.fc22 = nn.Linear(64, 128), nn.Linear(128, 8), nn.Linear(128, 8)
        self.fc3, self.fc4 = nn.Linear(8, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = F.relu(self.fc1(x))
        mu, logvar = self.fc21(h), self.fc22(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z)))), mu, logvar


def _vae(tmp_path, onset: int | None, steps: int = 250, parts: bool = False):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    protos = (torch.rand(10, 64, generator=gen) < 0.3).float()
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, objective="minimize") as diag:  # parts, not players
        for step in range(steps):
            x = (protos[torch.randint(0, 10, (128,), generator=gen)] + 0.1 * torch.rand(128, 64, generator=gen)).clamp(0, 1)
            recon, mu, logvar = model(x)
            bce = F.binary_cross_entropy(recon, x, reduction="sum")
            kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
            beta = -1.0 if onset is not None and step >= onset else 1.0  # the KL's sign flipped
            loss = bce + beta * kld
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step({"recon": bce, "kl": beta * kld} if parts else loss, outputs=recon, batch=(x,))
            losses.append(loss.item())
    return diag, losses


def _runaway(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.kind == "loss_runaway"]


def _loud(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


def test_vae_kl_flipped_from_the_start_is_said(tmp_path) -> None:
    diag, losses = _vae(tmp_path, onset=0)
    assert losses[0] > 1000 and min(losses) < -1e5  # the planted runaway: far below zero
    got = _runaway(diag)
    assert got and got[0].severity != "info" and got[0].where == "diag/loss", [(a.kind, a.step) for a in diag.alerts]
    assert got[0].step <= 100 and losses[got[0].step] < 0
    assert _loud(diag)[0].kind == "loss_runaway"  # said first, as a loss problem


def test_vae_kl_flipped_mid_run_is_said(tmp_path) -> None:
    onset = 120
    diag, losses = _vae(tmp_path, onset=onset)
    got = _runaway(diag)
    assert got and got[0].severity != "info", [(a.kind, a.step) for a in diag.alerts]
    assert onset <= got[0].step <= onset + 50, got[0].step


def test_vae_parts_as_a_dict_names_the_part(tmp_path) -> None:
    diag, _ = _vae(tmp_path, onset=0, parts=True)
    got = _runaway(diag)
    assert [a.where for a in got] == ["diag/kl/loss"] and got[0].step <= 100, [(a.kind, a.where, a.step) for a in diag.alerts]


def test_healthy_vae_raises_no_runaway(tmp_path) -> None:
    diag, losses = _vae(tmp_path, onset=None)
    assert losses[-1] < 0.8 * losses[0]  # it learned
    assert _runaway(diag) == [] and _loud(diag) == [], [(a.kind, a.step, a.message) for a in _loud(diag)]


class Flow(nn.Module):
    """Affine couplings on 2-D data with a standard-normal base: loss = the mean negative log-likelihood."""

    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.nets = nn.ModuleList(nn.Sequential(nn.Linear(1, 32), nn.Tanh(), nn.Linear(32, 2)) for _ in range(n))

    def nll(self, x: torch.Tensor) -> torch.Tensor:
        logdet = torch.zeros(len(x))
        for i, net in enumerate(self.nets):
            a, b = (x[:, :1], x[:, 1:]) if i % 2 == 0 else (x[:, 1:], x[:, :1])
            s, t = net(a).chunk(2, dim=1)
            s = torch.tanh(s) * 2
            b = (b - t) * torch.exp(-s)
            logdet = logdet - s.squeeze(1)
            x = torch.cat([a, b], 1) if i % 2 == 0 else torch.cat([b, a], 1)
        return (0.5 * (x ** 2).sum(1) + math.log(2 * math.pi) - logdet).mean()


def test_normalizing_flow_negative_nll_is_silent(tmp_path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = Flow()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF) as diag:
        for _ in range(400):
            u = torch.rand(256, generator=gen) * math.pi
            x = torch.stack([torch.cos(u), torch.sin(u)], 1) * 0.05 + 0.01 * torch.randn(256, 2, generator=gen)
            loss = model.nll(x)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
            losses.append(loss.item())
    assert losses[0] > 0 and sum(losses[-20:]) / 20 < -1.0  # started positive, converged below zero
    assert _runaway(diag) == [], [(a.step, a.message) for a in _runaway(diag)]


def _fed(values: list[float]) -> list[trackdiag.Alert]:
    """The rule alone, fed ``values`` (one a step) ten steps a record, as a logging step every 10 hands them over."""
    from trackdiag.core.record import Record

    rule, out = LossRunaway(), []
    for lo in range(0, len(values), 10):
        out += rule.check(Record(step=lo + 9, scalars={}, series={"diag/loss": list(enumerate(values))[lo:lo + 10]}), [], [])
    return out


def test_runaway_rule_on_series() -> None:
    """The rule alone: a positive start falling linearly far below zero is said at the step it crossed -10x;
    the same fall slowing down (converging at -12x) is not; nor is a loss that starts at -1 and converges at -8."""

    linear = [10.0] * 40 + [10.0 - 3.0 * i for i in range(160)]
    got = _fed(linear)
    assert [a.step for a in got] == [next(i for i, v in enumerate(linear) if v < -100.0)]
    assert got[0].severity == "critical"  # below zero and falling without slowing over three windows
    converging = [10.0] * 10 + [-120.0 + 130.0 * math.exp(-i / 15) for i in range(190)]
    assert _fed(converging) == []
    negative = [-1.0] * 10 + [-8.0 + 7.0 * math.exp(-i / 30) for i in range(190)]
    assert _fed(negative) == []


def test_a_loss_that_crossed_zero_both_ways_is_recorded_not_raised() -> None:
    """A policy-gradient loss integrated without ``objective="rl"`` takes both signs before its magnitude grows
    with the returns: the same steady fall below -10x its start is an info finding naming ``objective="rl"``;
    a loss that crossed zero once (the KL flipped) stays critical (the previous test)."""
    signed = [10.0, -4.0, 6.0, -3.0, 8.0, 5.0, -2.0, 7.0, 9.0, 4.0] * 3 + [10.0 - 3.0 * i for i in range(170)]
    got = _fed(signed)
    assert [a.severity for a in got] == ["info"], got
    assert 'objective="rl"' in got[0].hint and "crossed zero both ways" in got[0].message


def test_a_loss_that_starts_at_zero_is_recorded_not_raised() -> None:
    """A negative cosine similarity (SimSiam) starts near 0 by symmetry and falls along an S-curve towards -1: far
    beyond its tiny start, and still speeding up when it crosses the line drawn from its spread, then it levels off.
    Two healthy SimSiam runs of the rehearsal (2026-12-03: critical at step 49 before) and a logistic fall get at most
    an info finding that says the start was zero within its noise; a loss that starts clearly below zero and keeps
    falling is still raised."""

    wiggle = [-0.006, -0.004, -0.010, -0.012, 0.002, -0.007, -0.001, -0.022, -0.013, -0.002]
    s_curve = wiggle + [-0.72 / (1 + math.exp(-(i - 40) / 12)) + wiggle[i % 10] for i in range(390)]
    simsiam_s3 = [-0.0028, -0.0028, -0.0104, -0.0026, 0.0008, -0.01, -0.0194, -0.0067, -0.0131, -0.0088]
    medians = [-0.017, -0.071, -0.211, -0.327, -0.415, -0.477, -0.552, -0.593, -0.615, -0.65, -0.668, -0.666, -0.684,
               -0.688, -0.703, -0.707, -0.707, -0.709, -0.708, -0.719]  # of each 20 steps, as the run logged them
    simsiam_s3 += [medians[i // 20] + wiggle[i % 10] for i in range(10, 400)]
    for series in (s_curve, simsiam_s3):
        got = _fed(series)
        assert [a.severity for a in got] == ["info"] and "zero within its noise" in got[0].message, got
    clearly_negative = [-1.0 + 0.05 * w for w in wiggle] + [-1.0 - 0.5 * i for i in range(190)]
    got = _fed(clearly_negative)
    assert len(got) == 1 and got[0].severity == "critical" and "beyond its start" in got[0].message, got


def test_a_positive_start_falling_steeply_at_first_is_still_raised() -> None:
    """A start whose first steps fall steeply (their spread above their median) but stay positive is no zero start:
    a loss that then runs away below zero is raised as before."""
    steep = [8.0, 6.0, 4.5, 3.5, 2.9, 2.7, 2.5, 2.3, 2.2, 2.1] + [2.0 - 1.5 * i for i in range(190)]
    got = _fed(steep)
    assert [a.severity for a in got] == ["critical"] and "below zero" in got[0].message, got

"""An RL loop integrated without ``objective="rl"`` (issue 47 item 1): the loss summed over each episode grows
as episodes lengthen, its gradient norm with it, while the weights stay steady. A signed loss (it has been
negative) rising that way is recorded (info) with the hint naming ``objective="rl"``, not raised critical; a
planted NaN or learning rate x1000 in the same loop is still caught at its step.

``episode_loop``: an actor-critic step per "episode" on a fixed state stream (no simulator: fast), episodes
of 20 states for 120 steps, then 16x longer (320), as CartPole's do once the agent balances.
``tests/_rl_example.py``: the pytorch/examples actor-critic on CartPole itself (slow).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread, quiet_probes

RANK = {"info": 0, "warning": 1, "critical": 2}


def episode_loop(out: Path, level: str, fault: str | None = None, onset: int = 160, steps: int = 220) -> Any:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 3))  # 2 action logits + a value
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), probes=quiet_probes())
    gen = torch.Generator().manual_seed(1)
    with one_thread(), diag:
        for step in range(steps):
            if fault == "lr1000" and step == onset:
                for g in opt.param_groups:
                    g["lr"] *= 1000.0
            n = 20 if step < 120 else 320  # the episode's length: the agent balances longer
            x = torch.randn(n, 4, generator=gen)
            out_ = model(x)
            logp_all = F.log_softmax(out_[:, :2], dim=-1)
            if not torch.isfinite(logp_all).all():
                break  # NaN weights: the script's sampling would raise here
            act = torch.multinomial(logp_all.exp().detach(), 1, generator=gen)[:, 0]  # sampled actions
            logp = logp_all.gather(1, act[:, None])[:, 0]
            ret = 3.0 * (act == (x[:, 0] > 0).long()).float() + torch.randn(n, generator=gen)  # the right action pays
            ret = (ret - ret.mean()) / (ret.std() + 1e-8)  # normalised returns, as the example
            value = out_[:, 2]
            loss = (-logp * (ret - value.detach())).sum() + F.smooth_l1_loss(value, ret, reduction="sum")
            if fault == "nan" and step >= onset:
                loss = loss * torch.tensor(float("nan"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
    return diag


def loud(diag: Any, kinds: set[str] | None = None) -> list[Any]:
    return [a for a in diag.alerts if RANK[a.severity] >= 1 and (kinds is None or a.kind in kinds)]


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_longer_episodes_are_not_critical(tmp_path: Path, level: str) -> None:
    diag = episode_loop(tmp_path / level, level)
    assert not loud(diag, {"loss_spike", "loss_divergence"}), [(a.kind, a.step, a.severity, a.message) for a in loud(diag)]
    spikes = [a for a in diag.alerts if a.kind == "loss_spike"]
    assert spikes, [(a.kind, a.step, a.message) for a in diag.alerts]  # recorded
    assert 'objective="rl"' in spikes[0].hint and 'objective="rl"' in spikes[0].message


@pytest.mark.parametrize("fault, kinds", [("nan", {"nonfinite_loss"}), ("lr1000", None)])
def test_faults_in_the_same_loop_still_caught(tmp_path: Path, fault: str, kinds: set[str] | None) -> None:
    diag = episode_loop(tmp_path / fault, "advanced", fault=fault)
    found = loud(diag, kinds)
    assert found, [(a.kind, a.step, a.severity) for a in diag.alerts]
    first = min(found, key=lambda a: a.step)
    assert 160 <= first.step <= 163 and first.severity == "critical", (first.kind, first.step, first.severity)


def test_a_nonnegative_loss_keeps_its_verdict() -> None:
    """The relief is for signed losses only: the same jump of a loss that was never negative stays critical."""
    from trackdiag.core.record import Record
    from trackdiag.rules.loss import LossSpike

    rule, alerts = LossSpike(), []
    hist: list[Record] = []
    for step in range(200):
        n = 20 if step < 120 else 320
        v, g = 0.5 * n * (1 + 0.05 * ((step * 7) % 5)), 0.1 * n
        rec = Record(step=step, series={"diag/loss": [(step, v)], "diag/grad/global_norm": [(step, g)]})
        alerts += rule.check(rec, hist, [])
        hist.append(rec)
    assert [(a.step, a.severity) for a in alerts] == [(120, "critical")], [(a.step, a.severity) for a in alerts]
    assert 'objective="rl"' not in alerts[0].hint


@pytest.mark.slow
def test_pytorch_actor_critic_example(tmp_path: Path) -> None:
    """pytorch/examples' actor-critic on CartPole (tests/_rl_example.py): 150 episodes of at most 200 steps."""
    import _rl_example

    diag, rewards = _rl_example.run(tmp_path / "ac", level="advanced", seed=543, episodes=150, max_steps=200)
    assert len(rewards) == 150
    assert not [a for a in diag.alerts if a.severity == "critical"], [(a.kind, a.step, a.message) for a in diag.alerts]
    loss_alerts = [a for a in diag.alerts if a.kind in ("loss_spike", "loss_divergence") and a.step > 28]
    assert all('objective="rl"' in a.hint for a in loss_alerts), [(a.kind, a.step, a.hint) for a in loss_alerts]

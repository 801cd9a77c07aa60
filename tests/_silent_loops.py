"""Small digits classifiers with silent faults planted (issue 45 items 3 and 4), shared by
tests/test_silent_frozen.py and tests/test_silent_updates.py."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


class Net(nn.Module):
    """A 4-layer MLP; ``detach`` plants a stray ``.detach()`` after its second layer."""

    def __init__(self, detach: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.fc = nn.Linear(64, 128), nn.Linear(128, 128), nn.Linear(128, 64), nn.Linear(64, 10)
        self.detach = detach

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        if self.detach:
            h = h.detach()  # the stray .detach(): fc1 and fc2 never get a gradient
        return self.fc(torch.relu(self.fc3(h)))


def pretrained(gen: torch.Generator, xtr: torch.Tensor, ytr: torch.Tensor) -> Net:
    """A net trained 200 steps on the digits: a backbone worth freezing."""
    model = Net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    for _ in range(200):
        i = torch.randint(0, len(xtr), (64,), generator=gen)
        loss = F.cross_entropy(model(xtr[i]), ytr[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def run(out: Any, fault: str | None = None, *, steps: int = 150, lr: float = 1e-3, warmup: int = 0,
        ema: bool = False) -> tuple[trackdiag.Diagnostics, list[float]]:
    """Train ``Net`` with Adam under ``fault``: ``detached``, ``frozen_most`` (requires_grad=False on all but
    the last layer by mistake), ``finetune`` (a pretrained backbone frozen on purpose, a new head), ``lr0``,
    ``all_frozen`` (the optimizer holds only frozen parameters but the new head's). Returns the session and losses."""
    xtr, ytr, _, _ = digits()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = pretrained(gen, xtr, ytr) if fault == "finetune" else Net(detach=fault == "detached")
    if fault in ("frozen_most", "finetune"):
        model.requires_grad_(False)
        if fault == "finetune":
            model.fc.reset_parameters()
        model.fc.requires_grad_(True)
    opt = torch.optim.Adam(model.parameters(), lr=0.0 if fault == "lr0" else lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / warmup)) if warmup else None
    teacher = Net().requires_grad_(False) if ema else None
    losses: list[float] = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(out),
                                             probes=OFF) as diag:
        for _ in range(steps):
            i = torch.randint(0, len(xtr), (64,), generator=gen)
            x, y = xtr[i], ytr[i]
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            if teacher is not None:  # an EMA copy updated by hand, no optimizer
                with torch.no_grad():
                    for t, p in zip(teacher.parameters(), model.parameters()):
                        t.mul_(0.99).add_(p, alpha=0.01)
            diag.step(loss, outputs=logits, batch=(x, y))
            losses.append(loss.item())
    return diag, losses


def loud(diag: trackdiag.Diagnostics, kind: str | None = None) -> list[trackdiag.Alert]:
    """Warning-or-worse alerts (of ``kind``)."""
    return [a for a in diag.alerts if a.severity != "info" and (kind is None or a.kind == kind)]


def said(diag: trackdiag.Diagnostics) -> list[tuple[str, int, str, str]]:
    return [(a.kind, a.step, a.severity, a.message[:120]) for a in diag.alerts]


class Policy(nn.Module):
    """A small policy: tanh trunk, logits over 4 actions."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.pi = nn.Linear(64, 4)

    def forward(self, s: torch.Tensor) -> torch.Tensor:
        return self.pi(self.trunk(s))


def on_policy(out: Any, *, steps: int = 300, onset: int | None = None, level: str = "advanced") -> tuple[trackdiag.Diagnostics, list[float]]:
    """An on-policy policy gradient on a contextual bandit: the rewarded action is the argmax of a hidden
    linear map of the state; ``-log_prob * normalised return`` with an entropy bonus, Adam 3e-4,
    ``clip_grad_norm_(0.5)``; from ``onset`` on every learning rate x1000. Returns the session and mean rewards."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(8, 4, generator=gen)
    model = Policy()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    rewards: list[float] = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out),
                                             probes=OFF, objective="rl") as diag:
        for step in range(steps):
            if onset is not None and step == onset:
                for g in opt.param_groups:
                    g["lr"] *= 1000.0
            s = torch.randn(128, 8, generator=gen)
            logits = model(s)
            dist = torch.distributions.Categorical(logits=logits)
            a = dist.sample()
            r = (a == (s @ hidden).argmax(1)).float() + 0.1 * torch.randn(128, generator=gen)
            adv = (r - r.mean()) / (r.std() + 1e-8)  # normalised returns
            loss = -(dist.log_prob(a) * adv).mean() - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            diag.step(loss)
            rewards.append(float(r.mean()))
    return diag, rewards

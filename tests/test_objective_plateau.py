"""``plateau`` under ``objective="rl"``: docs/alert-policy.md says the rules about a loss going the wrong way
(plateau among them) are off for a component whose loss is not minimised, but the train-loss plateau was
raised for a DQN's TD loss and SAC's actor and critic losses (~1,000 steps of a level loss: the agent's own
bootstrap targets move with it). The same flat loss under ``minimize`` is still a plateau."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trackdiag


def flat_run(tmp_path: Path, objective: str) -> list:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path / objective),
                                 objective=objective)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    with diag:
        for _ in range(1300):
            loss = ((model(x) - y) ** 2).mean()  # a loss that stays where it is
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
    return [a for a in diag.alerts if a.kind == "plateau"]


@pytest.mark.parametrize("objective, expected", [("rl", 0), ("minimize", 1)])
def test_plateau_only_for_a_minimised_loss(tmp_path: Path, objective: str, expected: int) -> None:
    found = flat_run(tmp_path, objective)
    assert len(found) == expected, [(a.kind, a.step, a.message) for a in found]

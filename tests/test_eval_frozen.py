"""``eval_mode`` says nothing when the optimizer cannot change what eval mode affects (issue 47, item 4):
a model kept in eval on purpose with every parameter frozen (a feature-extraction loop), a frozen
feature extractor in eval under a trainable head in train mode (transfer learning), or an optimizer that
holds none of the eval-mode parameters. A model in eval whose trainable parameters the optimizer steps
is still reported, and so is one unfrozen later while it stays in eval."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag


class Net(nn.Module):
    """A backbone with BatchNorm and Dropout (both behave differently in eval mode) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.2))
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _loop(tmp_path: Any, prepare: Callable[[Net], list[torch.nn.Parameter]], steps: int = 12,
          at: Callable[[int, Net], None] | None = None, backward: bool = True) -> trackdiag.Diagnostics:
    """``prepare(model)`` sets the modes and ``requires_grad`` flags and returns what the optimizer holds;
    ``at(step, model)`` changes things mid-run."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(prepare(model), lr=0.05)
    x, y = torch.randn(256, 16), torch.randint(0, 4, (256,))
    diag = trackdiag.Diagnostics(model, opt, level="advanced", every=5, sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}})
    with diag:
        for step in range(steps):
            if at is not None:
                at(step, model)
            xb, yb = x[step * 32 % 256:][:32], y[step * 32 % 256:][:32]
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            if backward and loss.requires_grad:
                loss.backward()
            opt.step()
            diag.step(loss)
    return diag


def _eval_mode(diag: trackdiag.Diagnostics) -> list[Any]:
    return [a for a in diag.alerts if a.kind == "eval_mode"]


def test_a_frozen_model_kept_in_eval_is_not_reported(tmp_path):
    """Feature extraction: every parameter frozen, the model in eval, an optimizer with nothing to update."""
    def prepare(model: Net) -> list[torch.nn.Parameter]:
        model.requires_grad_(False)
        model.eval()
        return list(model.parameters())
    diag = _loop(tmp_path, prepare, backward=False)
    assert not _eval_mode(diag), [a.describe() for a in diag.alerts]


def test_a_frozen_extractor_in_eval_under_a_trainable_head_is_not_reported(tmp_path):
    """Transfer learning: ``model.eval()``, then the head back in train mode; the backbone frozen (its
    parameters still handed to the optimizer, which cannot change them)."""
    def prepare(model: Net) -> list[torch.nn.Parameter]:
        model.backbone.requires_grad_(False)
        model.eval()
        model.head.train()
        return list(model.parameters())
    diag = _loop(tmp_path, prepare)
    assert not _eval_mode(diag), [a.describe() for a in diag.alerts]


def test_eval_parameters_the_optimizer_does_not_hold_are_not_reported(tmp_path):
    """The backbone in eval still requires gradients but the optimizer steps only the head (in train mode)."""
    def prepare(model: Net) -> list[torch.nn.Parameter]:
        model.eval()
        model.head.train()
        return list(model.head.parameters())
    diag = _loop(tmp_path, prepare)
    assert not _eval_mode(diag), [a.describe() for a in diag.alerts]


def test_a_model_left_in_eval_with_trainable_parameters_is_reported(tmp_path):
    """``model.eval()`` over a frozen backbone and a trainable head: the head's Dropout is off while it trains."""
    def prepare(model: Net) -> list[torch.nn.Parameter]:
        model.backbone.requires_grad_(False)
        model.eval()
        return list(model.parameters())
    got = _eval_mode(_loop(tmp_path, prepare))
    assert len(got) == 1 and got[0].step == 0 and got[0].severity != "info", [a.describe() for a in got]
    assert "head.0" in got[0].where and "backbone.1" in got[0].where, got[0].describe()


def test_a_frozen_model_unfrozen_while_still_in_eval_is_reported(tmp_path):
    """Frozen and in eval (silent), then every parameter unfrozen at step 3 while the model stays in eval:
    reported once the session sees the new trainable parameters (its next logging step re-indexes them)."""
    def prepare(model: Net) -> list[torch.nn.Parameter]:
        model.requires_grad_(False)
        model.eval()
        return list(model.parameters())

    def at(step: int, model: Net) -> None:
        if step == 3:
            model.requires_grad_(True)
    got = _eval_mode(_loop(tmp_path, prepare, at=at))
    assert len(got) == 1 and 3 <= got[0].step <= 6, [a.describe() for a in got]

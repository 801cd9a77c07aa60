"""The NaN culprit when a module's output is rewritten by its own forward hooks (issue 47, item 5):
activation steering, pruning or quantisation observers and the user's hooks return a replacement output,
and the module whose output, as its caller sees it, first went non-finite is named, not the next module
('input non-finite'). The NaN replay (``advanced``) and the per-module flags of the real step
(``extreme``: diag.probes.flight.modules=true) agree; a NaN made by the next module itself is still
named there, and a hook that returns nothing (an observer) changes nothing."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.forensics.replay_recorder import Recorder

ONSET = 8


class Faulty(nn.Linear):
    """A Linear whose own forward makes a NaN once its ``fault`` buffer is 1 (``log(0) * 0``)."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.register_buffer("fault", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.log(1 - self.fault) * 0


def _nan_mask(out: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(out)
    mask[0, 0] = float("nan")
    return mask


def _run(tmp_path: Any, level: str, *, rewrite: str = "", observer: bool = False, steps: int = ONSET + 4) -> Any:
    """An MLP ``0 Linear, 1 ReLU, 2 Linear, 3 Faulty, 4 ReLU, 5 Linear``. ``rewrite``: ``"hook"``, a forward
    hook on ``2`` returns ``out * nan_mask`` from ``ONSET`` on (a replay reproduces it); ``"once"``, only in
    the real training forward of step ``ONSET`` (a replay never sees it); ``"next"``: ``3`` makes the NaN
    itself from ``ONSET`` on. ``observer``: a hook on ``2`` that returns nothing. Returns the first
    non-finite alert."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), Faulty(32), nn.ReLU(), nn.Linear(32, 4))
    now = {"step": -1, "fired": False}

    def steer(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if rewrite == "hook" and now["step"] >= ONSET:
            return out * _nan_mask(out)
        if rewrite == "once" and now["step"] == ONSET and module.training and not now["fired"]:
            now["fired"] = True
            return out * _nan_mask(out)
        return None
    seen: list[int] = []
    model[2].register_forward_hook(steer)
    if observer:
        model[2].register_forward_hook(lambda module, args, out: seen.append(out.shape[0]))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(256, 16, generator=torch.Generator().manual_seed(1)), torch.randint(0, 4, (256,))
    diag = trackdiag.Diagnostics(model, opt, level=level, every=5, sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}})
    with diag:
        for step in range(steps):
            now["step"] = step
            model[3].fault.fill_(1.0 if rewrite == "next" and step >= ONSET else 0.0)
            xb, yb = x[step * 32 % 256:][:32], y[step * 32 % 256:][:32]
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
    assert not observer or len(seen) >= steps  # the observer ran in every step
    got = [a for a in diag.alerts if a.kind in ("nonfinite_loss", "nonfinite_grad")]
    assert got, [a.describe() for a in diag.alerts]
    assert got[0].step == ONSET, got[0].describe()
    return got[0]


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_a_hook_that_rewrites_the_output_names_its_module(tmp_path, level):
    alert = _run(tmp_path, level, rewrite="hook")
    assert alert.where == "2 (Linear, input finite)", alert.describe()
    assert "a forward hook registered on it returned the non-finite one" in alert.message, alert.message


@pytest.mark.parametrize(("level", "observer"), [("advanced", False), ("advanced", True), ("extreme", True)])
def test_a_nan_made_by_the_next_module_still_names_it(tmp_path, level, observer):
    alert = _run(tmp_path, level, rewrite="next", observer=observer)
    assert alert.where == "3 (Faulty, input finite)", alert.describe()
    assert "forward hook" not in alert.message, alert.message


def test_the_flags_of_the_real_step_name_the_hooked_module(tmp_path):
    """A rewrite in one real forward only: the replay cannot reproduce it, the per-module flags (``extreme``)
    read the output the caller got and name the same module as the replay does."""
    alert = _run(tmp_path, "extreme", rewrite="once")
    assert alert.where == "2 (Linear, input finite, seen in the step's forward)", alert.describe()


class _Chain(nn.Module):
    def __init__(self, dot_forward: bool) -> None:
        super().__init__()
        self.a, self.b, self.dot = nn.Linear(4, 4), nn.Linear(4, 4), dot_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a.forward(x) if self.dot else self.a(x))


def test_the_recorder_judges_what_the_caller_gets():
    """An in-place rewrite by a hook that returns nothing is what ``a``'s caller gets: ``a`` is named. A
    layer called as ``a.forward(x)`` runs no hook: its caller gets a finite output and ``a`` is not named."""
    def poison(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        out.mul_(_nan_mask(out))
    for dot, first in ((False, "a"), (True, None)):
        model = _Chain(dot)
        model.a.register_forward_hook(poison)
        rec = Recorder(model, backward=False)
        try:
            with torch.no_grad():
                model(torch.ones(2, 4))
        finally:
            rec.remove()
        assert (rec.first[0] if rec.first else None) == first, (dot, rec.first)
        assert model.a.__dict__.get("forward") is None and len(model.a._forward_hooks) == 1  # the recorder's are gone

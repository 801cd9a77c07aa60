"""``grads_missing``: the optimizer steps and no gradient reaches any parameter it holds (issue: runs that are quietly
wrong; found in the second acceptance rehearsal, where a model replaced by ``copy.deepcopy`` was raised as a
"5e29-fold" ``grad_vanishing`` collapse with no place and the wrong remedy, and at ``basic`` not at all).

Each fault is planted at step ``ONSET`` (or from the first step) in a plain classification loop: the first alert of
warning or worse must be ``grads_missing`` at that step, and its message must name the cause the loss's graph shows.
Loops that legitimately step an optimizer without a gradient on some steps (a head of a task sampled at random) or
hold a model frozen on purpose raise nothing."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import trackdiag
from trackdiag.capture.graph_reach import graph_reach
from trackdiag.core.record import Record
from trackdiag.rules.grads_missing import GradsMissing

ONSET, STEPS = 60, 130


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))


def classify(out: Path, fault: str, *, level: str = "advanced", onset: int = ONSET) -> trackdiag.Diagnostics:
    """A learnable 4-class problem (labels from a fixed linear map), Adam, ``zero_grad(set_to_none=True)``; ``fault``
    planted from ``onset``: ``deepcopy`` (the model replaced by a copy, the optimizer kept), ``reload`` (a new instance
    given the old one's ``state_dict``), ``reinit`` (every parameter replaced by an assignment of a new
    ``nn.Parameter``), ``no_backward`` (``loss.backward()`` dropped), ``no_grad`` (the forward under
    ``torch.no_grad()``, the loss given ``requires_grad_(True)`` to silence autograd's error), ``none``."""
    torch.manual_seed(0)
    model = _net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    w = torch.randn(20, 4)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), budget=None,
                                 probes={"report": {"enabled": False}})
    with diag:
        for step in range(STEPS):
            if step == onset and fault == "deepcopy":
                model = copy.deepcopy(model)
            elif step == onset and fault == "reinit":  # every parameter replaced by assignment, the optimizer kept
                for layer in (model[0], model[2]):
                    layer.weight = nn.Parameter(layer.weight.detach().clone())
                    layer.bias = nn.Parameter(layer.bias.detach().clone())
            elif step == onset and fault == "reload":
                state = model.state_dict()
                model = _net()
                model.load_state_dict(state)
            x = torch.randn(64, 20)
            y = (x @ w).argmax(1)
            opt.zero_grad(set_to_none=True)
            if fault == "no_grad" and step >= onset:
                with torch.no_grad():
                    out_ = model(x)
                loss = nn.functional.cross_entropy(out_, y).requires_grad_(True)
            else:
                out_ = model(x)
                loss = nn.functional.cross_entropy(out_, y)
            if not (fault == "no_backward" and step >= onset):
                loss.backward()
            opt.step()
            diag.step(loss, outputs=out_, batch=(x, y))
    return diag


def _loud(diag: trackdiag.Diagnostics) -> list[trackdiag.Alert]:
    return [a for a in diag.alerts if a.severity != "info"]


CAUSES = {
    "deepcopy": "does not depend on any parameter this optimizer holds",
    "reload": "does not depend on any parameter this optimizer holds",
    "no_backward": "loss.backward() is not called",
    "no_grad": "was made to require grad with no graph behind it",
    "reinit": "the model's parameters were replaced after the optimizer was built",
}


@pytest.mark.parametrize("level", ["basic", "advanced"])
@pytest.mark.parametrize("fault", sorted(CAUSES))
def test_missing_gradients_are_raised_at_their_step_with_their_cause(tmp_path, fault: str, level: str) -> None:
    diag = classify(tmp_path, fault, level=level)
    loud = _loud(diag)
    assert loud, f"{fault}: nothing raised"
    first = loud[0]
    assert (first.kind, first.step, first.severity) == ("grads_missing", ONSET, "critical"), \
        [(a.kind, a.step, a.severity, a.message) for a in loud]
    assert CAUSES[fault] in first.message, first.message
    assert "5e" not in first.message and "fold" not in first.message
    assert not any(a.kind == "grad_vanishing" for a in diag.alerts), "the same finding twice, under a wrong name"


@pytest.mark.parametrize("fault", ["deepcopy", "no_backward"])
def test_missing_from_the_first_step_is_raised_there(tmp_path, fault: str) -> None:
    """An optimizer built over another model than the one trained, or a loop that never calls backward(): until now a
    ``not_learning`` at step 60 that blamed ``torch.no_grad``."""
    diag = classify(tmp_path, fault, onset=0)
    loud = _loud(diag)
    assert loud and (loud[0].kind, loud[0].step) == ("grads_missing", 0), [(a.kind, a.step) for a in loud]
    assert CAUSES[fault] in loud[0].message
    assert "since its first step" in loud[0].message


def test_healthy_loop_raises_nothing(tmp_path) -> None:
    diag = classify(tmp_path, "none")
    assert not _loud(diag), [(a.kind, a.step, a.message) for a in _loud(diag)]
    assert diag.summary()["health"] == "ok"


@pytest.mark.parametrize("share_a", [0.5, 0.9])
def test_heads_of_tasks_sampled_at_random_are_not_raised(tmp_path, share_a: float) -> None:
    """Two task heads over one trunk, each with its own optimizer stepped every iteration; one task sampled per
    iteration, so the other head's gradient is None on that step (Adam skips it): runs of steps without a gradient that
    are the loop's design."""
    torch.manual_seed(1)
    trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    heads = {"A": nn.Linear(32, 3), "B": nn.Linear(32, 5)}
    opts = {"trunk": torch.optim.Adam(trunk.parameters(), 1e-3), **{k: torch.optim.Adam(h.parameters(), 1e-3)
                                                                   for k, h in heads.items()}}
    diag = trackdiag.Diagnostics({"trunk": trunk, **heads}, opts, level="advanced", sinks=["local"],
                                 output_dir=str(tmp_path), budget=None, probes={"report": {"enabled": False}})
    gen = torch.Generator().manual_seed(2)
    with diag:
        for _ in range(300):
            task = "A" if torch.rand((), generator=gen) < share_a else "B"
            x = torch.randn(32, 16, generator=gen)
            y = torch.randint(0, 3 if task == "A" else 5, (32,), generator=gen)
            for o in opts.values():
                o.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(heads[task](trunk(x)), y)
            loss.backward()
            for o in opts.values():
                o.step()
            diag.step({"trunk": loss, task: loss}, batch=(x, y))
    missing = [a for a in diag.alerts if a.kind == "grads_missing"]
    assert not missing, [(a.step, a.where, a.message) for a in missing]


def test_a_model_frozen_on_purpose_is_not_raised(tmp_path) -> None:
    """Feature extraction: every parameter frozen, the optimizer built all the same (it has nothing to update)."""
    torch.manual_seed(0)
    model = _net().requires_grad_(False)
    probe = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path), budget=None,
                                 probes={"report": {"enabled": False}})
    with diag:
        for _ in range(60):
            x = torch.randn(32, 20)
            feats = model(x)
            loss = probe(feats).pow(2).mean()
            opt.step()
            diag.step(loss, batch=x)
    assert not [a for a in diag.alerts if a.kind == "grads_missing"]


def _reference_reaches(loss: torch.Tensor, params: list[torch.Tensor]) -> bool:
    """What autograd itself says: some gradient with respect to ``params`` is defined."""
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return any(g is not None for g in grads)


def test_graph_reach_agrees_with_autograd() -> None:
    torch.manual_seed(0)
    a, b = _net(), _net()
    x = torch.randn(8, 20)
    for loss, params in [(a(x).sum(), list(a.parameters())), (a(x).sum(), list(b.parameters())),
                         (a(x).sum() + b(x).sum(), list(b.parameters())[-1:]),
                         (a(b(torch.randn(8, 20))[:, :4].repeat(1, 5)).sum(), list(b.parameters())[:1]),
                         (a(x).detach().sum() * b(x).sum(), list(a.parameters()))]:
        got = graph_reach(loss, params)
        assert got["graph"] == 1.0
        assert got["reaches"] == float(_reference_reaches(loss, params)), got
    # after backward() the graph's nodes stay walkable while the loss is held
    loss = a(x).sum()
    loss.backward()
    assert graph_reach(loss, list(a.parameters())) == {"graph": 1.0, "reaches": 1.0}
    assert graph_reach(a(x).sum().detach(), list(a.parameters())) == {"graph": 0.0}  # a loss given for logging
    leaf = a(x).sum().detach().requires_grad_(True)  # a loss made to require grad: no graph of operations
    assert graph_reach(leaf, list(a.parameters())) == {"graph": 0.0, "leaf": 1.0}
    assert graph_reach(1.5, list(a.parameters())) == {}


def _records(values: list[float], window: int) -> list[Record]:
    out = []
    for end in range(window, len(values) + 1, window):
        r = Record(step=end - 1, time=0.0)
        r.series["diag/grad/global_norm"] = [(s, values[s]) for s in range(end - window, end)]
        out.append(r)
    return out


@pytest.mark.parametrize("window", [1, 10, 50])
def test_the_verdict_does_not_depend_on_the_logging_cadence(window: int) -> None:
    """The same every-step series cut into windows of 1, 10 or 50 steps: one finding, at the first step without a
    gradient (``grad_vanishing`` judged only each window's last steps, and at ``basic``'s 50 missed this)."""
    from trackdiag.capture.context import Component
    from trackdiag.capture.layers import LayerIndex

    model = _net()
    comp = Component("", model, None, LayerIndex.build(model, list(model.parameters()), 64))
    values = [0.5 + 0.01 * (s % 7) for s in range(130)] + [0.0] * 70
    rule = GradsMissing()
    found = [a for r in _records(values, window) for a in rule.check(r, [], [comp])]
    assert [(a.kind, a.step) for a in found] == [("grads_missing", 130)]
    # a short run of zeros (a step or two without a gradient) is no finding, and counts as steps without one
    rule = GradsMissing()
    gappy = [0.0 if s % 20 in (3, 4) else 0.5 for s in range(200)]
    assert not [a for r in _records(gappy, window) for a in rule.check(r, [], [comp])]

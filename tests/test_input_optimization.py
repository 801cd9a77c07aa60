"""Loops that optimise an input, not the model (issue 47 item 8): neural style transfer (LBFGS on the image,
the tutorial's loop) and feature visualisation (Adam on the image), both handing the image over as the batch.

Healthy runs raise no warning-or-worse (the fixed model's unused gradients are an ``info`` finding, LBFGS's
first huge steps on the clamped image are no ``update_ratio``); a learning rate x1000 planted in that optimizer
is named as a step-size problem, never as bad data that "a lower learning rate will not help"; an ordinary loop
whose optimizer misses trainable parameters still gets a critical ``param_not_optimized``.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import trackdiag
from _input_loops import feature_vis, style_transfer
from _zoo_a import quiet_probes

LOUD = ("warning", "critical")


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _loud(diag) -> list:
    return [a for a in diag.alerts if a.severity in LOUD]


def test_style_transfer_healthy_is_quiet_and_names_the_fixed_model(tmp_path) -> None:
    diag, img = style_transfer(tmp_path, level="advanced", seed=0, steps=25)
    assert 0.0 <= float(img.min()) and float(img.max()) <= 1.0
    assert _loud(diag) == [], [str(a) for a in _loud(diag)]
    (note,) = [a for a in diag.alerts if a.kind == "param_not_optimized"]
    assert note.severity == "info" and "not the model's parameters" in note.message
    assert "requires_grad_(False)" in note.hint and "conv_1" in note.where


def test_feature_vis_healthy_is_quiet_at_extreme(tmp_path) -> None:
    diag, _ = feature_vis(tmp_path, level="extreme", seed=1, steps=60)
    assert _loud(diag) == [], [str(a) for a in _loud(diag)]
    assert [a.severity for a in diag.alerts if a.kind == "param_not_optimized"] == ["info"]


def test_style_transfer_lr1000_is_a_step_size_problem(tmp_path) -> None:
    onset = 12
    diag, _ = style_transfer(tmp_path, level="advanced", seed=0, steps=onset + 4, fault="lr1000", onset=onset)
    loud = _loud(diag)
    assert loud, "the blow-up was missed"
    first = min(loud, key=lambda a: a.step)
    assert onset <= first.step <= onset + 2, str(first)
    assert all("will not help" not in a.hint for a in diag.alerts), [a.hint for a in diag.alerts]
    for a in loud:
        if a.kind.startswith("nonfinite"):
            assert "learning rate" in a.hint and "not brought by the data" in a.hint, str(a)


def test_feature_vis_lr1000_is_a_step_size_problem(tmp_path) -> None:
    onset = 40
    diag, _ = feature_vis(tmp_path, level="advanced", seed=0, steps=onset + 12, fault="lr1000", onset=onset)
    loud = _loud(diag)
    assert loud and all(onset <= a.step <= onset + 12 for a in loud), [str(a) for a in loud]
    assert all(a.kind in ("update_ratio", "loss_divergence", "update_scale") and "learning rate" in a.hint.lower()
               and "will not help" not in a.hint for a in loud), [str(a) for a in loud]  # update_scale: Adam hides it


@pytest.mark.parametrize("extra", [False, True], ids=["plain", "with_a_learned_prompt"])
def test_missing_model_parameters_stay_critical(tmp_path, extra: bool) -> None:
    """An ordinary loop whose optimizer forgot the head (also when it steps a non-model tensor besides the body)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    prompt = torch.zeros(8, requires_grad=True)
    params = [*model[0].parameters(), *([prompt] if extra else [])]
    opt = torch.optim.SGD(params, lr=0.1)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    with trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                               probes=quiet_probes()) as diag:
        for _ in range(5):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x + prompt), y)
            loss.backward()
            opt.step()
            diag.step(loss, batch=(x, y))
    (alert,) = [a for a in diag.alerts if a.kind == "param_not_optimized"]
    assert alert.severity == "critical" and alert.where == "2 (Linear)" and "add_param_group" in alert.hint

"""A silent error no issue named: the model input is one value everywhere (``constant_inputs``), and a model input
too small to learn from, named where the run sits at chance.

The bug: the preprocessing turns real data into zeros (an integer division ``uint8 // 255``, normalised values cast
back to an integer type, a mask or an input dropout of 1, a loader that returns a placeholder for images it cannot
read). Training runs, the loss sits at the entropy of the label frequencies, and before this rule the alerts blamed
the wrong thing: ``same_batch`` said a loader was restarted every step, ``mode_collapse`` said the outputs collapsed.
A second bug, images divided by 255 twice (``ToTensor()`` already did it), leaves inputs under 0.004: the at-chance
findings now say so.

Planted: the digits MLP fed ``x // 255`` (zeros), a dict batch whose images all failed to load (a placeholder),
each named at step 0 with its batch entry, before any other warning, at every preset. Healthy twins, silent: the same
loop on real inputs, a batch whose one value changes every step (a per-step condition), an input of mostly zeros
(sparse one-hot features), a loop that optimises its input from zeros (style transfer), a bandit's policy fed one
state (``objective="rl"``). The probe's figures are checked against the inputs themselves. And ``initial_loss``
names an input left unnormalised (pixels in 0-255), not the init, when the input is that large.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from conftest import LEAN_PROBES, batches, make_mlp
from trackdiag.core.record import read_records

STEPS = 120
WARN = ("warning", "critical")


def _run(tmp_path, digits, feed: Callable[[torch.Tensor, torch.Tensor, int], Any], *, level: str = "advanced",
         steps: int = STEPS, init_scale: float = 1.0, **kw: Any) -> tuple[Any, list[Any]]:
    """The digits MLP (its initial weights x ``init_scale``) on what ``feed(x, y, step)`` makes of each mini-batch (the
    batch handed to ``step()``; its input is what the model sees). Returns the session and the batches' inputs."""
    x, y = digits
    model = make_mlp(hidden=64)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(init_scale)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES,
                                 budget=None, **kw)
    data = batches(x, y, batch_size=32)
    seen = []
    for step in range(steps):
        batch = feed(*next(data), step)
        xb, yb = (batch["image"], batch["label"]) if isinstance(batch, dict) else batch
        seen.append(xb)
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        diag.step(loss, outputs=out, batch=batch)
    diag.close()
    return diag, seen


def _int_division(x: torch.Tensor, y: torch.Tensor, step: int) -> Any:
    return (x * 16).to(torch.uint8).div(255, rounding_mode="floor").float(), y  # uint8 // 255: every pixel 0


def _placeholders(x: torch.Tensor, y: torch.Tensor, step: int) -> Any:
    return {"image": torch.zeros_like(x), "label": y}  # every image failed to load: the loader's fallback


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("feed,entry", [(_int_division, "batch[0]"), (_placeholders, "batch['image']")],
                         ids=["int_division", "placeholders"])
def test_an_input_of_zeros_is_named_at_step_0_before_anything_else(tmp_path, digits, level, feed, entry) -> None:
    diag, _ = _run(tmp_path, digits, feed, level=level)
    warned = sorted((a for a in diag.alerts if a.severity in WARN), key=lambda a: (a.step, a.kind != "constant_inputs"))
    first = warned[0]
    assert first.kind == "constant_inputs" and first.step == 0, [(a.kind, a.step) for a in warned]
    assert first.where == f"input {entry}" and "zero in every position" in first.message
    assert "x // 255" in first.hint or "// 255" in first.hint
    kinds = {a.kind for a in diag.alerts}
    assert not kinds & {"same_batch", "mode_collapse"}, kinds  # the wrong causes are no longer named
    stuck = [a for a in diag.alerts if a.kind == "not_learning"]
    assert all("constant_inputs" in a.message for a in stuck), [a.message for a in stuck]


def test_the_probe_figures_match_the_inputs(tmp_path, digits) -> None:
    """``input_absmax`` is the largest |x| over each window's steps and ``inputs_constant_steps`` the run of steps whose
    input held one value, worked out here from the inputs themselves."""
    def feed(x, y, step):  # real inputs, then zeros from step 45 on
        return (x if step < 45 else torch.zeros_like(x)), y
    diag, seen = _run(tmp_path, digits, feed, steps=80)
    run_dir = next(p.parent for p in tmp_path.rglob("records.jsonl"))
    recs = [r for r in read_records(run_dir) if "diag/data/input_absmax" in r.scalars]
    assert recs
    prev = -1
    for r in recs:
        window = seen[prev + 1: r.step + 1]
        assert r.scalars["diag/data/input_absmax"] == pytest.approx(max(float(t.abs().max()) for t in window))
        run = 0
        for t in seen[: r.step + 1]:
            run = run + 1 if bool((t == t.flatten()[0]).all()) else 0
        assert r.scalars["diag/data/inputs_constant_steps"] == run, r.step
        assert r.scalars["diag/data/inputs_constant_first_step"] == (r.step - run + 1 if run else -1)
        prev = r.step
    assert [a.step for a in diag.alerts if a.kind == "constant_inputs"] == [45]


HEALTHY: dict[str, Callable[[torch.Tensor, torch.Tensor, int], Any]] = {
    "real_inputs": lambda x, y, step: (x, y),
    # a per-step condition: one value in every position, a new one each step (a timestep, a noise level)
    "one_value_per_step": lambda x, y, step: (torch.full_like(x, (step % 7) / 7.0), y),
    "sparse_one_hot": lambda x, y, step: (F.one_hot(y, 64).float(), y),  # mostly zeros, one 1 per row
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_inputs_raise_no_constant_inputs(tmp_path, digits, name) -> None:
    diag, _ = _run(tmp_path, digits, HEALTHY[name])
    assert "constant_inputs" not in {a.kind for a in diag.alerts}, [(a.kind, a.step, a.message) for a in diag.alerts]
    if name != "one_value_per_step":  # that one learns the label frequencies only, by design
        assert not [a for a in diag.alerts if a.severity in WARN], [(a.kind, a.step) for a in diag.alerts]


def test_an_input_the_optimizer_steps_from_zeros_is_not_flagged(tmp_path) -> None:
    """Style transfer / feature visualisation: the batch is the image being optimised, starting from zeros."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    for p in net.parameters():
        p.requires_grad_(False)
    img = torch.zeros(1, 3, 16, 16, requires_grad=True)
    opt = torch.optim.Adam([img], lr=0.05)
    target = torch.randn(1, 8)
    diag = trackdiag.Diagnostics(net, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES,
                                 budget=None)
    for _ in range(60):
        out = net(img)
        loss = F.mse_loss(out, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        diag.step(loss, outputs=out, batch=img)
    diag.close()
    assert "constant_inputs" not in {a.kind for a in diag.alerts}


def test_a_bandit_policy_fed_one_state_is_not_flagged(tmp_path) -> None:
    """A multi-armed bandit: the policy's input is the one state there is, by design (``objective="rl"``)."""
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    means = torch.tensor([0.1, 0.5, 0.9])
    diag = trackdiag.Diagnostics(policy, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 probes=LEAN_PROBES, budget=None, objective="rl")
    for _ in range(60):
        state = torch.ones(32, 4)
        dist = torch.distributions.Categorical(logits=policy(state))
        action = dist.sample()
        reward = torch.bernoulli(means[action])
        loss = -(dist.log_prob(action) * (reward - reward.mean())).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        diag.step(loss, batch=(state, action))
    diag.close()
    assert "constant_inputs" not in {a.kind for a in diag.alerts}


def test_inputs_divided_by_255_twice_are_named_when_the_run_sits_at_chance(tmp_path, digits) -> None:
    diag, _ = _run(tmp_path, digits, lambda x, y, step: (x / 255.0, y), steps=200)  # digits in [0, 1], then / 255
    stuck = [a for a in diag.alerts if a.kind == "not_learning"]
    assert stuck, [(a.kind, a.step) for a in diag.alerts]
    assert "input is tiny" in stuck[0].message and "0.0039" in stuck[0].message
    assert "constant_inputs" not in {a.kind for a in diag.alerts}


def test_pixels_left_in_0_255_are_named_by_initial_loss(tmp_path, digits) -> None:
    diag, seen = _run(tmp_path, digits, lambda x, y, step: (x * 255.0, y), steps=30)
    first = [a for a in diag.alerts if a.kind == "initial_loss"]
    assert first and first[0].step == 0, [(a.kind, a.step) for a in diag.alerts]
    top = max(float(t.abs().max()) for t in seen[:10])  # the first logging step's window
    assert f"reaches {top:.4g} in magnitude" in first[0].message and "not normalised" in first[0].message


def test_a_bad_init_on_normalised_inputs_does_not_blame_the_inputs(tmp_path, digits) -> None:
    """Weights x100 at init: the init's fault, not the data's."""
    diag, _ = _run(tmp_path, digits, lambda x, y, step: (x, y), level="basic", steps=20, init_scale=100.0)
    first = [a for a in diag.alerts if a.kind == "initial_loss"]
    assert first and "in magnitude" not in first[0].message, [(a.kind, a.message) for a in diag.alerts]

"""A run that sits at chance says why when the record shows it (``not_learning``'s message): a weight decay that
shrinks every weight 10 % a step (``weight_decay=1.0`` typed for 1e-4 under SGD at lr 0.1), a learning rate so low
that no layer's update reaches 1e-5 of its weights (Adam at 1e-7, SGD at 1e-6). Labels shuffled against their inputs,
the classic at-chance run, gets none of these causes: its weights move and nothing decays them. (The model input of
one value everywhere and the tiny input: tests/test_silent_inputs.py.)
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from conftest import LEAN_PROBES, batches, make_mlp
from trackdiag.core.record import read_records


def _chance_run(tmp_path, digits, opt_of, *, level: str = "advanced", steps: int = 200, shuffle: bool = False,
                step_first: bool = False, weight: float = 1.0, no_grad_forward: bool = False, folded: bool = False):
    """The digits MLP with the optimizer ``opt_of(params)``; ``shuffle``: labels permuted within each batch;
    ``step_first``: ``zero_grad(); step(); backward()`` (the optimizer steps on no gradient); ``weight``: the loss's
    factor (0: a loss weight of 0); ``no_grad_forward``: the forward under ``torch.no_grad()`` and the loss made to
    require grad (the fix for autograd's "does not require grad" error that trains nothing). Returns the session and
    its ``not_learning`` alert; ``folded``: the first alert instead (``not_learning`` folded into it)."""
    x, y = digits
    model = make_mlp(hidden=64)
    opt = opt_of(model.parameters())
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES,
                                 budget=None)
    gen = torch.Generator().manual_seed(3)
    for _, (xb, yb) in zip(range(steps), batches(x, y)):
        if shuffle:
            yb = yb[torch.randperm(len(yb), generator=gen)]
        if no_grad_forward:
            with torch.no_grad():
                out = model(xb)
            loss = F.cross_entropy(out, yb).requires_grad_(True)
        else:
            out = model(xb)
            loss = weight * F.cross_entropy(out, yb)
        opt.zero_grad()
        if step_first:
            opt.step()
        loss.backward()
        if not step_first:
            opt.step()
        diag.step(loss, outputs=out, batch=(xb, yb))
    diag.close()
    stuck = diag.alerts[:1] if folded else [a for a in diag.alerts if a.kind == "not_learning"]
    assert stuck, [(a.kind, a.step) for a in diag.alerts]
    return diag, stuck[0]


def test_weight_decay_that_pulls_the_weights_to_zero_is_named_when_the_run_sits_at_chance(tmp_path, digits) -> None:
    """``weight_decay=1.0`` under SGD at lr 0.1 (meant 1e-4): every weight shrinks 10 % a step, the run sits at chance."""
    _, stuck = _chance_run(tmp_path, digits, lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=1.0), level="basic")
    assert "weight decay shrinks every weight by 10% a step (lr 0.1 x weight_decay 1)" in stuck.message, stuck.message
    run_dir = next(p.parent for p in tmp_path.rglob("records.jsonl"))
    lr_records = [r for r in read_records(run_dir) if "diag/opt/lr" in r.scalars]
    assert lr_records and {r.scalars.get("diag/opt/weight_decay") for r in lr_records} == {1.0}


@pytest.mark.parametrize("name,opt_of", [("adam_1e-7", lambda p: torch.optim.Adam(p, lr=1e-7)),
                                         ("sgd_1e-6", lambda p: torch.optim.SGD(p, lr=1e-6))], ids=["adam", "sgd"])
def test_a_learning_rate_far_too_low_is_named_when_the_run_sits_at_chance(tmp_path, digits, name, opt_of) -> None:
    _, stuck = _chance_run(tmp_path, digits, opt_of)
    assert "the weights barely move: the largest update-to-weight ratio of a layer is" in stuck.message, stuck.message
    run_dir = next(p.parent for p in tmp_path.rglob("records.jsonl"))
    ratios = [v for r in read_records(run_dir) for k, v in r.scalars.items() if k.startswith("diag/update/ratio/")]
    assert ratios and max(ratios) < 1e-5  # what the message says, read back from the record


def test_shuffled_labels_at_chance_name_no_decay_and_no_still_weights(tmp_path, digits) -> None:
    _, stuck = _chance_run(tmp_path, digits, lambda p: torch.optim.AdamW(p, lr=1e-3), shuffle=True)
    assert "ignores its input" in stuck.message
    for cause in ("weight decay", "barely move", "tiny", "constant_inputs"):
        assert cause not in stuck.message, stuck.message


def test_updates_that_never_land_are_not_blamed_on_the_learning_rate(tmp_path, digits) -> None:
    """``zero_grad(); step(); backward()``: the optimizer steps on no gradient, every update ratio is exactly 0.
    ``grads_wiped`` names that; ``not_learning`` must not suggest a learning rate too low."""
    diag, stuck = _chance_run(tmp_path, digits, lambda p: torch.optim.Adam(p, lr=1e-3), step_first=True)
    assert "grads_wiped" in {a.kind for a in diag.alerts}
    assert "barely move" not in stuck.message, stuck.message


def test_a_loss_that_is_exactly_zero_from_the_start_is_a_warning(tmp_path, digits) -> None:
    """``loss = 0 * cross_entropy`` (a loss weight of 0 from a config): the loss is 0 at every step and nothing
    trains. It was an ``info`` "less than 5 % lower" (0 to 0, far below chance); now a warning that says the loss
    does not measure the predictions, against ln C of the output's classes (the task cannot be read from a loss of 0)."""
    diag, stuck = _chance_run(tmp_path / "zero", digits, lambda p: torch.optim.Adam(p, lr=1e-3), weight=0.0)
    assert (stuck.severity, stuck.step) == ("warning", 100), stuck
    assert "exactly 0 at every step" in stuck.message and "ln C of the output's 10 classes is 2.303" in stuck.message
    records = list(read_records(diag.summary()["output_dir"]))  # the reference: every loss and gradient norm was 0
    losses = [v for r in records for _, v in r.series.get("diag/loss", [])]
    norms = [v for r in records for _, v in r.series.get("diag/grad/global_norm", [])]
    assert len(losses) == len(norms) == 200 and not any(losses) and not any(norms)


def test_a_loss_weight_of_one_learns_and_raises_no_not_learning(tmp_path, digits) -> None:
    """The same loop with the weight 1: the loss falls, no ``not_learning`` of any severity."""
    x, y = digits
    model = make_mlp(hidden=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                               probes=LEAN_PROBES, budget=None) as diag:
        for _, (xb, yb) in zip(range(200), batches(x, y)):
            out = model(xb)
            loss = 1.0 * F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
    assert not [a for a in diag.alerts if a.kind == "not_learning"], diag.alerts
    assert loss.item() < 0.5


def test_a_forward_under_no_grad_with_a_loss_made_to_require_grad_is_named(tmp_path, digits) -> None:
    """``with torch.no_grad(): out = model(x)`` then ``loss.requires_grad_(True)`` (what silences autograd's error):
    backward runs, no parameter gets a gradient, the run sits at chance; the message says so and why. Shuffled labels,
    whose gradients flow, do not get this cause (test_shuffled_labels_at_chance_name_no_decay_and_no_still_weights)."""
    diag, stuck = _chance_run(tmp_path, digits, lambda p: torch.optim.Adam(p, lr=1e-3), no_grad_forward=True,
                              folded=True)
    # raised at its first step by grads_missing, with the cause the loss shows; the stalled loss that follows is its
    # consequence, folded into it (not a second fault)
    assert (stuck.kind, stuck.step, stuck.severity) == ("grads_missing", 0, "critical")
    assert "was made to require grad with no graph behind it" in stuck.message and "torch.no_grad()" in stuck.message
    assert diag.summary()["consequences_suppressed"].get("not_learning"), diag.summary()["consequences_suppressed"]
    records = list(read_records(diag.summary()["output_dir"]))  # the reference: every pre-clip norm was 0
    assert not any(v for r in records for _, v in r.series.get("diag/grad/global_norm", []))
    _, shuffled = _chance_run(tmp_path / "shuffled", digits, lambda p: torch.optim.SGD(p, lr=0.05), shuffle=True)
    assert "no parameter has had a gradient" not in shuffled.message

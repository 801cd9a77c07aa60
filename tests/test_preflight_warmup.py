"""The automatic pre-flight's one-batch fit when step 0's learning rate is a schedule's first value.

nanoGPT's older ``get_lr`` gives ``lr = learning_rate * it / warmup_iters``: 0 at iteration 0; an LR range
test (torch-lr-finder, its exponential schedule stepped after each update) starts at 1e-7; a ``LinearLR`` warm-up at 1/1000 of the base.
The pre-flight copies the optimizer as it is after step 0, ran 30 steps at that rate, saw the loss not move
and said "the model cannot fit one batch" (warning) on healthy runs. Now a fit that barely moved the weights
(< 2 % of their size) at a rate the schedule is still raising is inconclusive, said so; a constant rate far
too small is still a failed check, and so is a fit that moved the weights without lowering the loss. A range
test that sets each step's rate before the step, as fastai's does, has not moved its rate yet at step 0: the
fit's verdict waits for step 1's rate (a constant one: the failure, named at step 0).
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from _zoo_b import batches, mlp, session

STEPS = 3


def run(tmp_path, lr_at: Callable[[int], float], opt_lr: float = 1e-3, scheduler: str | None = None, after: bool = False):
    """The first ``STEPS`` steps of an MLP on digits at ``extreme`` (the pre-flight runs at step 0), the
    learning rate set by hand before each step (``lr_at(step)``; ``after``: for the next step, after this one's
    update, as torch-lr-finder's scheduler does) or by a torch ``scheduler``."""
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=opt_lr)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=100) if scheduler == "linear" else None
    diag = session(model, opt, tmp_path, "extreme", probes={"report": {"enabled": False}, "histograms": {"enabled": False},
                                                             "landscape": {"enabled": False}})
    with diag:
        for step, (x, y) in enumerate(batches(STEPS)):
            if sched is None and not (after and step):
                for g in opt.param_groups:
                    g["lr"] = lr_at(step)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
            if after:
                for g in opt.param_groups:
                    g["lr"] = lr_at(step + 1)
            diag.step(loss, outputs=out, batch=(x, y))
    return [a for a in diag.alerts if a.kind == "preflight"], diag


@pytest.mark.parametrize("schedule", ["warmup_from_0", "lr_range_test", "linear_warmup"])
def test_a_schedule_starting_near_zero_leaves_the_fit_inconclusive(tmp_path, schedule) -> None:
    lr_at = {"warmup_from_0": lambda s: 1e-3 * s / 100,
             "lr_range_test": lambda s: 1e-7 * (1e8 ** (s / 99)),
             "linear_warmup": None}[schedule]
    found, _ = run(tmp_path, lr_at, scheduler="linear" if schedule == "linear_warmup" else None,
                   after=schedule == "lr_range_test")
    assert found == [], found


def test_a_constant_learning_rate_far_too_small_still_fails_the_fit(tmp_path) -> None:
    found, _ = run(tmp_path, lambda s: 1e-7)
    assert [(a.severity, a.where, a.step) for a in found] == [("warning", "overfit", 0)], found
    assert "cannot fit one batch" in found[0].message and "learning rate of 1e-07" in found[0].message


def test_a_range_test_that_sets_each_rate_before_its_step_is_inconclusive(tmp_path) -> None:
    """fastai's ``lr_find`` sets each step's rate before the step: at step 0 the rate has not moved yet, so only
    step 1 tells it from a constant rate far too small. The fit's verdict waits for it (held, then dropped)."""
    found, diag = run(tmp_path, lambda s: 1e-7 * (1e8 ** (s / 99)))
    assert found == [], found
    assert diag._held_fit is None


def test_a_constant_rate_far_too_small_is_named_at_step_0_after_one_run_of_one_step(tmp_path) -> None:
    """The held verdict of a run that ends after its first step is given at close."""
    global STEPS
    kept, STEPS = STEPS, 1
    try:
        found, _ = run(tmp_path, lambda s: 1e-7)
    finally:
        STEPS = kept
    assert [(a.severity, a.where, a.step) for a in found] == [("warning", "overfit", 0)], found

"""A silent error no issue named: a scheduler meant per epoch stepped every batch (``lr_vanished``). The learning rate
falls 10,000x in a hundred-odd batches and the run goes on with weights that no longer move; nothing crashes, and
before this rule the only alert was ``stale_params`` saying the updates do not land because the optimizer holds
tensors the model no longer uses.

Planted: ``StepLR(step_size=30)``, ``MultiStepLR([30, 60, 80, 90, 100])`` and ``ExponentialLR(0.95)`` stepped per batch,
each caught at the step its rate went under 1e-4 of the peak (worked out here from the scheduler's own rates).
Healthy twins, silent at every preset: the same schedulers stepped per epoch, cosine annealing to 0, linear warm-up
and decay to 0 (the Hugging Face schedule), ``OneCycleLR``, warm restarts, ``ReduceLROnPlateau`` cutting the rate
every 3 epochs down to its ``min_lr``,
a second optimizer at a 1e-6 fine-tuning rate after pre-training at 0.1, and an LR set to 0 on purpose.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from conftest import LEAN_PROBES, batches, make_mlp

STEPS = 400
EPOCH = 20  # batches per "epoch" of these loops


def _run(tmp_path, digits, make_sched: Callable[[torch.optim.Optimizer], Any], *, per_batch: bool, level: str = "advanced",
         steps: int = STEPS, lr: float = 0.05, plateau: bool = False, phases: bool = False) -> tuple[Any, dict[int, float]]:
    """A digits MLP; the scheduler stepped every batch (``per_batch``) or every ``EPOCH`` batches. Returns the session and
    the learning rate each step ran with."""
    x, y = digits
    torch.manual_seed(0)
    model = make_mlp(hidden=64)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = make_sched(opt) if make_sched is not None else None
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES,
                                 budget=None)
    data = batches(x, y)
    rates: dict[int, float] = {}
    for step in range(steps):
        if phases and step == steps // 2:  # fine-tuning: a new optimizer at a far lower rate
            opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
            diag.attach(opt)
        rates[step] = opt.param_groups[0]["lr"]
        xb, yb = next(data)
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None and not phases:
            if plateau:
                if (step + 1) % EPOCH == 0:
                    sched.step(1.0)  # a validation loss that never improves: every patience, a reduction
            elif per_batch or (step + 1) % EPOCH == 0:
                sched.step()
        diag.step(loss, outputs=out, batch=(xb, yb))
    diag.close()
    return diag, rates


PLANTED = {
    "steplr": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=30, gamma=0.1),
    "multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[30, 60, 80, 90, 100], gamma=0.1),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.95),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_per_epoch_scheduler_stepped_per_batch_is_named_at_the_step_its_rate_vanished(tmp_path, digits, name) -> None:
    diag, rates = _run(tmp_path, digits, PLANTED[name], per_batch=True)
    first = min((a for a in diag.alerts if a.severity in ("warning", "critical")), key=lambda a: a.step)
    assert first.kind == "lr_vanished", [(a.kind, a.step) for a in diag.alerts]
    peak = max(rates.values())
    below = min(s for s, r in rates.items() if 0 < r < 1e-4 * peak)
    # the rate is read at the logging steps (every 10): the first one at or after the step it went under
    assert below <= first.step < below + 10, (first.step, below)
    assert "per epoch" in first.message and first.where == "diag/opt/lr"


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_stepped_per_batch_at_every_preset(tmp_path, digits, level) -> None:
    diag, _ = _run(tmp_path, digits, PLANTED["steplr"], per_batch=True, level=level)
    assert "lr_vanished" in {a.kind for a in diag.alerts}


def test_stale_params_names_the_vanished_rate_not_orphaned_tensors(tmp_path, digits) -> None:
    diag, _ = _run(tmp_path, digits, PLANTED["steplr"], per_batch=True, steps=700)
    stale = [a for a in diag.alerts if a.kind == "stale_params"]
    assert stale and all("learning rate is" in a.message and "of its peak" in a.message for a in stale), stale


HEALTHY: dict[str, tuple[Callable[[torch.optim.Optimizer], Any], dict[str, Any]]] = {
    "steplr_per_epoch": (PLANTED["steplr"], {"per_batch": False}),
    "multistep_per_epoch": (lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[5, 10, 15], gamma=0.1),
                            {"per_batch": False}),
    "exponential_per_epoch": (PLANTED["exponential"], {"per_batch": False}),
    "cosine_to_zero": (lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.0),
                       {"per_batch": True}),
    "linear_warmup_decay_to_zero": (lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: s / 40 if s < 40 else max(0.0, (STEPS - s) / (STEPS - 40))), {"per_batch": True}),
    "one_cycle": (lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS), {"per_batch": True}),
    "warm_restarts": (lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=50, eta_min=0.0),
                      {"per_batch": True}),
    "plateau_reductions": (lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, factor=0.1, patience=2, min_lr=1e-5),
                           {"per_batch": False, "plateau": True}),
    "finetune_phase": (PLANTED["steplr"], {"per_batch": False, "phases": True}),
    "lr_zero": (None, {"per_batch": False, "lr": 0.0}),
}


@pytest.mark.parametrize("name", sorted(HEALTHY))
def test_healthy_schedules_raise_no_lr_vanished(tmp_path, digits, name) -> None:
    make, kw = HEALTHY[name]
    diag, rates = _run(tmp_path, digits, make, **kw)
    assert "lr_vanished" not in {a.kind for a in diag.alerts}, [(a.kind, a.step, a.message) for a in diag.alerts]
    if name in ("cosine_to_zero", "one_cycle", "linear_warmup_decay_to_zero"):
        peak = max(rates.values())
        assert min(r for r in rates.values() if r > 0) < 1e-2 * peak  # the schedule did come down to ~0 by the end


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_linear_decay_run_past_its_end_is_a_negative_rate(tmp_path, digits, level) -> None:
    """``LambdaLR(opt, lambda s: 1 - s / 150)`` in a 400-step run: from step 150 the rate is below 0 and SGD climbs the
    loss. ``lr_negative`` (critical) at the first logging step whose rate is negative, worked out here from the rates
    the steps ran with; the HF-style clamped decay run past its end (``linear_warmup_decay_to_zero`` above, and the same
    lambda clamped at 0 here) has none."""
    diag, rates = _run(tmp_path, digits, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 - s / 150),
                       per_batch=True, level=level)
    found = [a for a in diag.alerts if a.kind == "lr_negative"]
    assert [a.severity for a in found] == ["critical"], [(a.kind, a.step) for a in diag.alerts]
    below = min(s for s, r in rates.items() if r < 0)  # the rate a step ran with; the record reads it after the step
    every = 50 if level == "basic" else 10
    assert below - 1 <= found[0].step < below - 1 + every, (found[0].step, below)
    assert "below 0" in found[0].message and "climbs the loss" in found[0].message
    clamped, _ = _run(tmp_path / "clamped", digits, lambda o: torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: max(0.0, 1 - s / 150)), per_batch=True, level=level)
    assert "lr_negative" not in {a.kind for a in clamped.alerts}

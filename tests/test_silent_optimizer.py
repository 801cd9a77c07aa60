"""A silent error no issue named: the optimizer built inside the training loop (``optimizer_recreated``).

``opt = torch.optim.Adam(model.parameters(), lr)`` one line too low: a fresh optimizer every batch. Nothing crashes and
the loss falls, but Adam's moment estimates restart each step (it becomes sign descent at the learning rate), momentum
SGD loses its momentum, and a scheduler built on the first optimizer changes nothing.

Before: trackdiag adopted every new optimizer and kept each one alive with its state (a memory leak of its own making,
1.5 MB a step on a 130k-parameter MLP, then blamed on the user's code by ``memory_leak``), took each one's first step
for a new training phase (every rule's history started over at every step), reported the learning rate of the first
optimizer, and raised nothing about the loop.

Now: an optimizer of the same class over the same parameters replaces the one before it (which is let go); three
such steps in a row by optimizers that keep state raise ``optimizer_recreated`` (warning) at the streak's first step.
Healthy twins, silent: plain SGD rebuilt each step (no state to lose), an optimizer rebuilt per epoch at a decayed
rate, a second stage's optimizer, and two optimizers kept and alternated.
"""
from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from conftest import LEAN_PROBES, batches, make_mlp

Make = Callable[[Any], torch.optim.Optimizer]


def adam(params: Any, lr: float = 1e-3) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def _run(tmp_path, digits, make: Make, *, rebuild: Callable[[int], bool], level: str = "advanced", steps: int = 120,
         nan_at: int = -1, alternate: bool = False, on_step: Callable[[int, Any], None] | None = None) -> trackdiag.Diagnostics:
    """A digits MLP; a new optimizer from ``make`` before the steps where ``rebuild(step)``; a NaN planted in the
    input at ``nan_at``; ``alternate``: two optimizers built once, stepped in turn."""
    x, y = digits
    torch.manual_seed(0)
    model = make_mlp(hidden=64)
    opt = make(model.parameters())
    other = make(model.parameters()) if alternate else None
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES,
                                 budget=None)
    data = batches(x, y)
    with diag:
        for step in range(steps):
            if rebuild(step):
                opt = make(model.parameters())
            use = other if alternate and step % 2 else opt
            xb, yb = next(data)
            if step == nan_at:
                xb = xb.clone()
                xb[0, 3] = float("nan")
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            use.zero_grad()
            loss.backward()
            use.step()
            if on_step is not None:
                on_step(step, use)
            if diag.step(loss, outputs=out, batch=(xb, yb)):
                break
    return diag


def _found(diag: trackdiag.Diagnostics, kind: str = "optimizer_recreated") -> list[Any]:
    return [a for a in diag.alerts if a.kind == kind]


def _raised_at(diag: trackdiag.Diagnostics, kind: str) -> int:
    from trackdiag.core.record import read_records

    run_dir = diag.summary()["output_dir"]
    return next(r.step for r in read_records(run_dir) if any(a.kind == kind for a in r.alerts))


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_adam_built_every_step_is_found(tmp_path, digits, level: str) -> None:
    diag = _run(tmp_path, digits, adam, rebuild=lambda s: True, level=level)
    found = _found(diag)
    assert len(found) == 1, diag.alerts
    a = found[0]
    assert (a.step, a.severity, a.where) == (0, "warning", "diag/opt/recreated"), a
    assert "new Adam" in a.message and "sign descent" in a.message and "inside the training loop" in a.message
    assert "before the training loop" in a.hint
    first = min((x for x in diag.alerts if x.severity != "info"), key=lambda x: x.step)
    assert first.kind == "optimizer_recreated", diag.alerts
    assert _raised_at(diag, "optimizer_recreated") <= 50  # basic's first logging step after three steps


def test_the_streak_in_the_record_counts_the_replacements(tmp_path, digits) -> None:
    """``diag/opt/recreated``: built anew from step 30 on, kept from step 80: the table's streak and total against the
    loop's own count, at every logging step."""
    from trackdiag.core.record import read_records

    rebuilt = lambda s: 30 <= s < 80  # noqa: E731
    diag = _run(tmp_path, digits, adam, rebuild=rebuilt, steps=100)
    rows = {r.step: r.tables.get("diag/opt/recreated") for r in read_records(diag.summary()["output_dir"])
            if "diag/opt/lr" in r.scalars}  # the lr probe's records
    for step, table in rows.items():
        total = sum(1 for s in range(step + 1) if rebuilt(s))
        if total == 0:
            assert table is None, (step, table)
            continue
        streak = step - 30 + 1 if rebuilt(step) else 0
        assert table == {"steps": streak, "since": 30.0, "total": total, "stateful": 1.0}, (step, table)
    assert _found(diag)[0].step == 30


def test_replaced_optimizers_are_let_go_and_the_lr_is_the_latest(tmp_path, digits) -> None:
    """Kept alive, every optimizer built in the loop held its state: the session must keep none but the latest. The
    learning rate logged is the one the step used (each new optimizer at a lower rate)."""
    from trackdiag.core.record import read_records

    refs: list[weakref.ref] = []
    rates: dict[int, float] = {}

    def seen(step: int, opt: Any) -> None:
        refs.append(weakref.ref(opt))
        rates[step] = opt.param_groups[0]["lr"]

    counter = iter(range(10_000))
    diag = _run(tmp_path, digits, lambda p: adam(p, lr=1e-3 * 0.99 ** next(counter)), rebuild=lambda s: True,
                steps=60, on_step=seen)
    gc.collect()
    assert sum(r() is not None for r in refs) <= 2, "replaced optimizers are still alive"
    logged = {r.step: r.scalars["diag/opt/lr"] for r in read_records(diag.summary()["output_dir"])
              if "diag/opt/lr" in r.scalars}
    assert logged and all(logged[s] == pytest.approx(rates[s]) for s in logged), (logged, rates)


def test_momentum_sgd_built_every_step_is_found(tmp_path, digits) -> None:
    diag = _run(tmp_path, digits, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), rebuild=lambda s: s >= 10)
    found = _found(diag)
    assert [(a.step, a.severity) for a in found] == [(10, "warning")], diag.alerts
    assert "new SGD" in found[0].message and "momentum" in found[0].message


def test_a_nan_is_still_named_at_its_step(tmp_path, digits) -> None:
    """Each new optimizer's first step began a training phase before: rules judged every step against an empty
    history. A NaN planted in the input at step 40 is named at 40 (its own alert), beside the loop's."""
    diag = _run(tmp_path, digits, adam, rebuild=lambda s: True, nan_at=40)
    kinds = {a.kind: a.step for a in diag.alerts if a.severity != "info"}
    assert kinds.get("optimizer_recreated") == 0 and kinds.get("nonfinite_input") == 40, diag.alerts


@pytest.mark.parametrize("kind", ["adam", "sgd_momentum"])
def test_an_lr_x1000_is_still_caught_at_its_step(tmp_path, digits, kind: str) -> None:
    """The learning rate of the optimizer built each step x1000 from step 40: with every step a phase of its own, the
    build before raised nothing (Adam) or ``grad_flow`` at step 50 (momentum SGD); now ``grad_explosion`` at 41, the
    first step the larger rate's update shows in the gradients."""
    base = 1e-3 if kind == "adam" else 0.05
    counter = iter(range(10_000))

    def make(params: Any) -> torch.optim.Optimizer:
        lr = base * (1000 if next(counter) > 40 else 1)  # the step-0 optimizer is built before the loop: +1
        return adam(params, lr) if kind == "adam" else torch.optim.SGD(params, lr=lr, momentum=0.9)

    diag = _run(tmp_path, digits, make, rebuild=lambda s: True)
    first = [a for a in diag.alerts if a.severity != "info" and a.kind != "optimizer_recreated"]
    assert first and (first[0].kind, first[0].step) == ("grad_explosion", 41), diag.alerts


@pytest.mark.parametrize("case", ["plain_sgd_every_step", "per_epoch_decay", "second_stage", "two_alternated"])
def test_healthy_rebuilds_are_silent(tmp_path, digits, case: str) -> None:
    counter = iter(range(10_000))
    if case == "plain_sgd_every_step":  # no state to lose: the same training as one optimizer
        diag = _run(tmp_path, digits, lambda p: torch.optim.SGD(p, lr=0.1), rebuild=lambda s: True)
    elif case == "per_epoch_decay":  # old code's schedule: a new optimizer each epoch at a lower rate
        diag = _run(tmp_path, digits, lambda p: adam(p, lr=3e-3 * 0.5 ** next(counter)), rebuild=lambda s: s % 20 == 0,
                    steps=200)
    elif case == "second_stage":
        diag = _run(tmp_path, digits, lambda p: adam(p, lr=1e-3 if next(counter) == 0 else 1e-4),
                    rebuild=lambda s: s == 100, steps=200)
    else:
        diag = _run(tmp_path, digits, adam, rebuild=lambda s: False, alternate=True)
    assert not _found(diag), diag.alerts
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts

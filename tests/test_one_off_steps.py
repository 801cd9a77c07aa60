"""One step whose gradients were thrown away or carried over is not the accumulation mistake.

Loops that are right leave one such step behind now and then: a notebook cell interrupted between
``backward()`` and ``step()`` and run again, an out-of-memory retry, a batch skipped because its
gradients were not finite (fairseq, speech recipes). Before, that single step raised a *critical*
``accumulation_reset`` or ``grads_not_zeroed``; now it is an ``info`` finding that says what a one-off
usually is, and the mistake (every step, or from some step on) is still critical at its first step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread, quiet_probes

LEVELS = ["basic", "advanced", "extreme"]
KINDS = ("accumulation_reset", "grads_not_zeroed")


def run(tmp_path, level: str, zero: str, skipped: set[int], every_from: int | None = None, steps: int = 60,
        log_every: int | None = None) -> trackdiag.Diagnostics:
    """``zero``: where the loop zeroes. "before" (before backward): at each step in ``skipped`` a
    backward pass whose step never comes (interrupted before ``step()``, or the batch dropped), so the
    next step's ``zero_grad`` throws it away. "after" (after the step): at each step in ``skipped`` the
    ``zero_grad()`` is skipped (an error handler's ``continue`` placed before it), so the next step
    adds onto its gradients. From ``every_from`` on, that happens at every step (the mistake)."""
    xtr, ytr, _, _ = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    kw = {"every": log_every} if log_every else {}
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                 probes=quiet_probes(), **kw)
    with one_thread(), diag:
        for step in range(steps):
            x, y = xtr[step * 32 % 1024:][:32], ytr[step * 32 % 1024:][:32]
            odd = step in skipped or (every_from is not None and step >= every_from)
            if zero == "before":
                if odd:
                    opt.zero_grad()
                    F.cross_entropy(model(x[:16]), y[:16]).backward()  # ... and then the step does not come
                    x, y = x[16:], y[16:]
                opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            diag.step(loss)
            if zero == "after" and not odd:
                opt.zero_grad()
    return diag


def found(diag) -> list[tuple[str, str, int]]:
    return [(a.kind, a.severity, a.step) for a in diag.alerts if a.kind in KINDS]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("zero,kind,seen", [("before", "accumulation_reset", [8, 41]), ("after", "grads_not_zeroed", [9, 42])])
def test_one_interrupted_step_is_an_info_finding(tmp_path, level, zero, kind, seen) -> None:
    """8 and 41 lost a pass; 9 and 42 added onto the gradients of the steps before them. Two one-offs
    of one kind in one place are one incident (the second folded into the first), also when one
    logging window holds both (``basic``: 50 steps)."""
    diag = run(tmp_path, level, zero, skipped={8, 41})
    alerts = [a for a in diag.alerts if a.kind in KINDS]
    assert [(a.kind, a.severity, a.step, a.last_step) for a in alerts] == [(kind, "info", *seen)], diag.alerts
    assert "Once is what an interrupted and resumed step" in alerts[0].message
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("zero,kind", [("before", "accumulation_reset"), ("after", "grads_not_zeroed")])
def test_the_mistake_is_critical_at_its_first_step(tmp_path, level, zero, kind) -> None:
    """The mistake from step 29 on: the first failing step is 30 (``grads_not_zeroed``: 29's gradients
    carried into 30; ``accumulation_reset``: the first several-pass step after 20 one-pass steps is
    not judged, see the probe), the last step of a logging window at ``every=10`` (steps 0, 10, 20,
    30, ...): that window holds one failing step, the next one tells. Critical, at step 30, once."""
    diag = run(tmp_path, level, zero, skipped=set(), every_from=29, steps=45, log_every=10)
    assert found(diag) == [(kind, "critical", 30)], diag.alerts


def test_a_one_off_in_the_last_window_is_told_at_the_end(tmp_path) -> None:
    """``basic`` logs at steps 0 and 50, then at the end (59): step 5 waits for the record at 50, which
    shows nothing near it, step 58 for the end; one incident of two one-offs."""
    diag = run(tmp_path, "basic", "before", skipped={5, 58}, steps=60)
    alerts = [a for a in diag.alerts if a.kind in KINDS]
    assert [(a.kind, a.severity, a.step, a.last_step) for a in alerts] == [("accumulation_reset", "info", 5, 58)]

"""A notebook's training cell interrupted (Ctrl-C: KeyboardInterrupt) and run again, many times, with
the session left open (no ``with`` block): the interrupt can land on any line of trackdiag's step,
hooks and probes. Afterwards training goes on as if nothing happened: no warning, no probe switched
off, every later step recorded.

The interrupts are placed deterministically: a trace function raises KeyboardInterrupt at the N-th
line trackdiag executes within a step, for N spread over the whole step (with
``_thread.interrupt_main`` a real SIGINT-style interrupt lands at random; ``test_sink_hub.py``
covers that for the queue to the sinks).
"""
from __future__ import annotations

import linecache
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread
from trackdiag.core.record import read_records

PACKAGE = trackdiag.__file__.rsplit("/", 1)[0]


def _WITH(filename: str, line: int) -> bool:
    return linecache.getline(filename, line).lstrip().startswith("with ")


class InterruptAt:
    """Raise KeyboardInterrupt at the ``n``-th line executed in trackdiag's files (once). Not on a
    ``with`` line: the tracer also reports it when the block ends, just before ``__exit__`` runs, a
    point a real signal cannot reach (CPython checks for signals after a call returns, inside the block)."""

    def __init__(self, n: int) -> None:
        self.n, self.seen, self.fired = n, 0, False

    def __call__(self, frame, event, arg):  # type: ignore[no-untyped-def]
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None
        if event == "line" and not self.fired and not _WITH(frame.f_code.co_filename, frame.f_lineno):
            self.seen += 1
            if self.seen >= self.n:
                self.fired = True
                raise KeyboardInterrupt
        return self


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_interrupted_and_resumed_steps_leave_no_trace(tmp_path, level) -> None:
    xtr, ytr, _, _ = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), every=5)
    interrupted = []

    def one(step: int) -> None:
        x, y = xtr[step * 32 % 1024:][:32], ytr[step * 32 % 1024:][:32]
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        diag.step(loss, outputs=out, batch=(x, y))

    with one_thread():
        step = 0
        for _ in range(30):  # warm up: every probe has run, lazy imports are done
            one(step)
            step += 1
        for n in range(1, 2000, 23):  # one interrupt per step, at a later line each time
            trap = InterruptAt(n)
            sys.settrace(trap)
            try:
                one(step)
            except KeyboardInterrupt:
                interrupted.append(step)
            finally:
                sys.settrace(None)
            step += 1
            for _ in range(5):  # the cell is run again: clean steps (a one-off is not a habit: see rules/zerograd.py)
                one(step)
                step += 1
        for _ in range(60):
            one(step)
            step += 1
        diag.close()
    assert len(interrupted) > 20  # the traps fired inside the step (late ones fall past its last line)
    loud = [(a.kind, a.severity, a.step) for a in diag.alerts if a.severity != "info"]
    assert loud == [], diag.alerts
    assert diag.summary()["disabled_probes"] == {}
    losses = sorted({s for r in read_records(tmp_path) for k, s, _ in r.points() if k == "diag/loss"})
    end = diag.global_step  # steps whose diag.step() was cut short are not counted
    assert step - len(interrupted) <= end <= step
    assert losses[-60:] == list(range(end - 60, end))  # the steps after the last interrupt, every one
    assert torch.is_grad_enabled()

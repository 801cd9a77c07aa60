"""Issue 44: a non-logging step's Python work. A plain ``basic`` step (one backward pass, one optimizer, no scaler, no
gradient probe due) costs a bounded number of trackdiag Python calls and torch ops, counted deterministically
(``sys.setprofile``, a counting dispatch mode), and the exact-step checks still name the step of a NaN/Inf gradient
planted between two logging steps.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import trackdiag
from conftest import LEAN_PROBES, make_mlp

PKG = str(Path(trackdiag.__file__).parent)

#: trackdiag Python frames in a plain ``basic`` step of a 3-layer MLP (backward hooks and the end-of-backward
#: measurement, the optimizer's step hooks, ``Diagnostics.step``): 74 before issue 44's step path, 61 after, 57 with
#: the plain path of ``Diagnostics.step``
CALLS = 60
#: torch ops trackdiag adds to such a step: the per-tensor gradient norms (one ``_foreach_norm``), the loss's
#: ``detach`` and the batch's NaN/Inf check (one ``aminmax``)
OPS = 3


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _loop(tmp: Path, steps: int, on: bool = True, plant: int = -1, level: str = "basic"):
    model = make_mlp(hidden=32, depth=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp), budget=None,
                                 probes=LEAN_PROBES) if on else None
    gen = torch.Generator().manual_seed(0)

    def step(i: int) -> None:
        x = torch.randn(64, 64, generator=gen)
        y = torch.randint(0, 10, (64,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        if i == plant:  # a NaN in one gradient, the loss finite
            model[2].weight.register_hook(lambda g: torch.full_like(g, float("nan")))
        loss.backward()
        if i == plant:
            model[2].weight._backward_hooks.clear()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if diag is not None:
            diag.step(loss, batch=(x, y))

    for i in range(steps):
        step(i)
    return diag, step


def _traced(step: Any, i: int, where: str = PKG) -> int:
    n = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(where):
            n[0] += 1

    sys.setprofile(prof)
    try:
        step(i)
    finally:
        sys.setprofile(None)
    return n[0]


def test_plain_basic_step_is_a_few_calls_and_ops(tmp_path: Path) -> None:
    diag, step = _loop(tmp_path / "on", 60)
    _, bare = _loop(tmp_path / "off", 60, on=False)
    calls = [_traced(step, i) for i in range(60, 70)]  # the next logging step is 100
    assert diag is not None and diag.summary()["steps"] == 70
    assert max(calls) <= CALLS, calls
    ops = []
    for i in range(70, 75):
        with _Ops() as on:
            step(i)
        with _Ops() as off:
            bare(i)
        ops.append(on.n - off.n)
    assert max(ops) <= OPS, ops
    diag.close()


def test_nan_gradient_between_logging_steps_is_named_at_its_step(tmp_path: Path) -> None:
    diag, _ = _loop(tmp_path, 120, plant=73)
    assert diag is not None
    diag.close()
    first = diag.summary()["alerts"]
    assert first["nonfinite_grad"]["first_step"] == 73, first


def test_due_checks_between_logging_steps_call_no_schedule_of_the_plan(tmp_path: Path) -> None:
    """``advanced``: a dozen probes ask ``ctx.is_due`` in a step; between logging steps the plan answers for every
    probe's schedule (11-12 schedule calls a step before, 3-4 now: schedules of a probe's own)."""
    diag, step = _loop(tmp_path, 61, level="advanced")
    where = str(Path(PKG) / "util" / "schedule.py")
    calls = [_traced(step, i, where) for i in range(61, 70)]  # logging steps at 60 and 70
    assert diag is not None and max(calls) <= 4, calls
    diag.close()


def _records(tmp: Path, level: str, lane: bool, monkeypatch: Any) -> list[dict[str, Any]]:
    """A run's records without what the clock decides (timings, throughput, overhead)."""
    from trackdiag.core.record import read_records
    from trackdiag.session.diagnostics import Diagnostics

    with monkeypatch.context() as m:
        if not lane:
            m.setattr(Diagnostics, "_lane_open", lambda self: False)
        diag, _ = _loop(tmp, 130, plant=73, level=level)
        assert diag is not None
        diag.close()
    timed = ("diag/perf/", "diag/throughput/", "diag/mem/")
    out = []
    for r in read_records(tmp):
        out.append({"step": r.step, "alerts": [(a.kind, a.step, a.where) for a in r.alerts],
                    "scalars": {k: v for k, v in r.scalars.items() if not k.startswith(timed)},
                    "series": r.series})
    return out


def test_the_plain_path_records_what_the_full_path_does(tmp_path: Path, monkeypatch: Any) -> None:
    """``Diagnostics.step`` takes a shorter path on plain steps (``_plain``); forced to take the full one on every
    step, the same run (a NaN gradient planted between logging steps, then its anomaly window) records the same
    series, scalars and alerts at the same steps."""
    for level in ("basic", "advanced"):
        plain = _records(tmp_path / f"{level}-plain", level, True, monkeypatch)
        full = _records(tmp_path / f"{level}-full", level, False, monkeypatch)
        assert [r["step"] for r in plain] == [r["step"] for r in full], level
        assert any(r["alerts"] for r in plain), level  # the planted NaN was found
        for a, b in zip(plain, full):
            assert a["alerts"] == b["alerts"], (level, a["step"])
            assert a["series"].keys() == b["series"].keys(), (level, a["step"])
            for k, pts in a["series"].items():
                assert [(st, repr(v)) for st, v in pts] == [(st, repr(v)) for st, v in b["series"][k]], (level, k)
            assert a["scalars"].keys() == b["scalars"].keys(), (level, a["step"])
            for k, v in a["scalars"].items():
                w = b["scalars"][k]
                assert v == w or (v != v and w != w), (level, a["step"], k, v, w)


def test_most_steps_take_the_plain_path(tmp_path: Path) -> None:
    from trackdiag.session.diagnostics import Diagnostics

    taken = [0]
    orig = Diagnostics._plain

    def counted(self: Any, *args: Any) -> bool:
        taken[0] += 1
        return orig(self, *args)

    Diagnostics._plain = counted  # type: ignore[method-assign]
    try:
        diag, _ = _loop(tmp_path, 200)
    finally:
        Diagnostics._plain = orig  # type: ignore[method-assign]
    assert diag is not None
    diag.close()
    assert taken[0] >= 190, taken  # logging steps 0, 50, 100, 150 and the first step take the full one

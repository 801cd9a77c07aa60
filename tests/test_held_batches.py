"""Issue 44: the label checks of a non-logging step cost no device op. A step's targets of up to 4,096 labels are kept
by reference and reduced with the window's others at the logging step (``trackdiag.util.held``); the checks name the
same steps as when each step's targets were reduced at their step, larger targets are still reduced at their step,
and a loader that writes each batch into one reused tensor is detected and checked at each step from then on.

References are computed another way: label statistics with Python's ``min``/``max`` over the label lists, the first
non-finite step from where the test planted it.
"""
from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import trackdiag
from conftest import LEAN_PROBES, make_mlp
from trackdiag.core.record import read_records
from trackdiag.probes.data import HOLD_LABELS, label_stats

EVERY = 10


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _records(diag: trackdiag.Diagnostics) -> dict[int, Any]:
    """The run's local records by step."""
    return {r.step: r for r in read_records(Path(diag.summary()["output_dir"]))}


def _loop(tmp: Path, steps: int, make: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]],
          level: str = "advanced", static: bool = False, classes: int = 10) -> trackdiag.Diagnostics:
    """A classifier trained on ``make(step, gen)``'s batches, ``diag.step(loss, outputs=, batch=(x, y))``; with
    ``static`` every batch is copied into the same two tensors first (a CUDA-graph loop's static inputs)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp), budget=None,
                                 every=EVERY, probes=LEAN_PROBES)
    gen = torch.Generator().manual_seed(1)
    sx = sy = None
    for i in range(steps):
        x, y = make(i, gen)
        if static:
            if sx is None or sx.shape != x.shape:
                sx, sy = x.clone(), y.clone()
            sx.copy_(x)
            sy.copy_(y)
            x, y = sx, sy
        out = model(torch.nan_to_num(x, 0.0, 0.0, 0.0))  # trained on finite values: a planted NaN stays in the batch only
        loss = F.cross_entropy(out, y.clamp(0, classes - 1))  # a loss that cannot crash on the planted labels
        opt.zero_grad()
        loss.backward()
        opt.step()
        diag.step(loss, outputs=out, batch=(x, y))
    diag.close()
    return diag


def _batch(n: int = 32) -> Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]:
    return lambda i, g: (torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


# ---------------------------------------------------------------- the window's label statistics
def _reference(rows: list[list[int]], classes: int, inputs: list[list[int]] | None) -> list[list[float]]:
    """label_stats' six columns with Python's min and max over each step's labels."""
    small, big = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    out = []
    for k, r in enumerate(rows):
        negative = [v for v in r if v < 0]
        over = [v for v in r if v >= classes]
        within = [v for v in r if v < classes]
        same = -1.0 if inputs is None else sum(a == b for a, b in zip(inputs[k], r)) / len(r)
        out.append([min(r), max(r), max(negative, default=small), same, min(over, default=big), max(within, default=small)])
    return out


@pytest.mark.parametrize("with_inputs", [False, True])
def test_label_stats_of_a_window_equal_each_steps_by_hand(with_inputs: bool) -> None:
    rnd = random.Random(3)
    pool = [*range(10), -100, -1, 10, 11, 255]
    rows = [[rnd.choice(pool) if rnd.random() < 0.2 else rnd.randrange(10) for _ in range(24)] for _ in range(40)]
    rows[5] = [7] * 24  # one class
    rows[6] = [-100] * 24  # all padding
    inputs = [[rnd.randrange(12) for _ in range(24)] for _ in range(40)] if with_inputs else None
    if inputs is not None:
        inputs[9] = list(rows[9])  # targets equal to the inputs
    got = label_stats(torch.tensor(rows), 10, torch.tensor(inputs) if inputs is not None else None)
    want = _reference(rows, 10, inputs)
    # the same float32 -> float64 rounding as the stacked row (exact for these values; the sentinels rounded alike)
    want = torch.tensor(want, dtype=torch.float64).float().double()
    assert got.dtype == torch.float64 and got.shape == (40, 6)
    assert torch.equal(got, want)


def test_a_window_of_batch_sizes_is_judged_in_step_order(tmp_path: Path) -> None:
    """Batches of 32 and an epoch's last batch of 7, in turn: the rows are reduced by size and put back in step order;
    the first 1-based step and the window's label range are the ones the batches held."""
    sizes = {i: 7 if i % 4 == 3 else 32 for i in range(40)}
    held: dict[int, tuple[int, int]] = {}

    def make(i: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(sizes[i], 16, generator=g), torch.randint(0, 10, (sizes[i],), generator=g)
        if i in (23, 27):  # two short batches labelled 1..10
            y = y + 1
            y[0] = 10
        if i == 24:  # a padding value in a long one, learnt as the ignore index
            y[0] = -100
        held[i] = (int(y[y != -100].min()), int(y[y != -100].max()))
        return x, y

    diag = _loop(tmp_path, 40, make)
    (alert,) = [a for a in diag.alerts if a.kind == "label_range"]
    assert alert.step == 23, alert
    s = _records(diag)[30].scalars
    window = range(21, 31)  # the record of step 30 (the first ten steps are logged one by one)
    assert s["diag/data/label_first_bad_step"] == 23 and s["diag/data/label_bad_steps"] == 2
    assert s["diag/data/label_max"] == max(held[i][1] for i in window) == 10
    assert s["diag/data/label_min"] == min(held[i][0] for i in window)
    assert s["diag/data/ignore_index"] == -100


# ---------------------------------------------------------------- what a non-logging step launches
def _step_ops(tmp: Path, n: int, level: str) -> list[str]:
    """The torch ops trackdiag's ``diag.step`` launches on a non-logging step of batches of ``n`` rows."""
    torch.manual_seed(0)
    model = make_mlp(hidden=32, depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp), budget=None,
                                 every=EVERY, probes=LEAN_PROBES)
    gen = torch.Generator().manual_seed(1)
    ops: list[str] = []
    for i in range(3 * EVERY + 4):  # past the class count of the first 20 steps (alerts.marginal)
        x, y = torch.randn(n, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen)
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == 3 * EVERY + 2:
            with _Ops() as counted:
                diag.step(loss, outputs=out, batch=(x, y))
            ops = counted.names
        else:
            diag.step(loss, outputs=out, batch=(x, y))
    diag.close()
    return ops


def test_small_targets_cost_no_op_at_their_step_and_large_ones_are_reduced_then(tmp_path: Path) -> None:
    small = _step_ops(tmp_path / "small", 64, "advanced")
    assert not [op for op in small if "where" in op or "lt." in op or "ge." in op], small  # data_labels: kept
    # the loss's detach, the inputs' NaN/Inf check (aminmax), the batch fingerprint (view, dot): 17 ops before
    assert len(small) <= 4, small
    large = _step_ops(tmp_path / "large", HOLD_LABELS + 1, "advanced")
    assert len([op for op in large if "where" in op]) == 3, large  # reduced at its step: the three masked reductions


# ---------------------------------------------------------------- exact steps, kept or reduced at once
@pytest.mark.parametrize("rows", [32, HOLD_LABELS + 8], ids=["kept", "reduced-at-its-step"])
def test_a_label_out_of_range_is_named_at_its_step_either_way(tmp_path: Path, rows: int) -> None:
    def make(i: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(rows, 16, generator=g), torch.randint(0, 10, (rows,), generator=g)
        if i == 26:
            y[3] = 10
        return x, y

    diag = _loop(tmp_path, 40, make)
    rec = _records(diag)[30]
    assert rec.scalars["diag/data/label_first_bad_step"] == 26 and rec.scalars["diag/data/label_bad_steps"] == 1
    assert rec.scalars["diag/data/label_max"] == 10


# ---------------------------------------------------------------- a loader that reuses one tensor
def test_batches_written_into_one_tensor_are_checked_at_their_step_once_seen(tmp_path: Path, caplog) -> None:
    """A CUDA-graph style loop copies every batch into the same two tensors: the first window's kept targets
    changed before the logging step (said once), and from then on each step is reduced at its step, so a 1-based
    label planted later is named at its step (and a NaN in the inputs, checked at each step anyway)."""
    def make(i: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)
        if i == 24:
            x[0, 0] = float("inf")
        if i == 33:
            y = y + 1
            y[0] = 10
        return x, y

    with caplog.at_level(logging.INFO, logger="trackdiag"):
        diag = _loop(tmp_path, 40, make, static=True)
    said = [r.getMessage() for r in caplog.records if "written in place" in r.getMessage()]
    assert len(said) == 1 and "data_labels: targets" in said[0] and f"{EVERY - 1} step(s)" in said[0], said
    firsts = [(r.scalars.get("diag/data/nonfinite_first_step"), r.scalars.get("diag/data/label_first_bad_step"))
              for r in _records(diag).values()]
    assert {n for n, _ in firsts} - {-1.0, None} == {24.0} and {b for _, b in firsts} - {-1.0, None} == {33.0}, firsts
    assert {a.kind: a.step for a in diag.alerts if a.kind in ("label_range", "nonfinite_input")} == \
        {"nonfinite_input": 24, "label_range": 33}


def test_healthy_classifier_raises_nothing_and_checks_every_step(tmp_path: Path) -> None:
    diag = _loop(tmp_path, 60, _batch())
    assert not [a for a in diag.alerts if a.severity in ("warning", "critical")], diag.alerts
    recs = [r.scalars for r in _records(diag).values() if "diag/data/label_bad_steps" in r.scalars]
    assert recs and all(s["diag/data/label_first_bad_step"] == -1 and s["diag/data/nonfinite_first_step"] == -1 for s in recs)
    assert sum(s["diag/data/label_batches"] for s in recs) == 60  # every step's labels were judged

"""A regression loss between outputs ``(N, 1)`` and targets ``(N,)`` (``loss_broadcast``).

``F.mse_loss(model(x), y)`` broadcasts both to ``(N, N)``: nothing crashes, torch warns once, and the model learns the
targets' mean. Planted: MSE, L1, smooth-L1, Huber, a summed MSE and the transposed pair ``(N,)`` against ``(N, 1)``,
each found at its first step, critical, with both shapes in the message; the values the record keeps are checked
against ``torch.nn.functional`` computed here. Healthy twins: the same loop squeezing the output inside its loss
(the shapes it hands over still broadcast: the probe measures, the loss is the aligned one, nothing is said), and
matched shapes or a classification loop (nothing measured at all).
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}

LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mse": F.mse_loss,
    "l1": F.l1_loss,
    "smooth_l1": F.smooth_l1_loss,
    "huber": F.huber_loss,
    "mse_sum": lambda o, y: F.mse_loss(o, y, reduction="sum"),
}


def _regression(tmp_path, loss_fn, *, steps: int = 60, squeeze: bool = False, transpose: bool = False,
                level: str = "basic"):
    """A tabular regression (8 features, a linear teacher plus noise); the model's output is ``(N, 1)``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, generator=gen)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    with warnings.catch_warnings(), one_thread(), trackdiag.Diagnostics(
            model, opt, level=level, every=10, sinks=["local"], output_dir=str(tmp_path), probes=OFF) as diag:
        warnings.simplefilter("ignore", UserWarning)  # torch's own "target size ... different to the input size"
        for step in range(steps):
            x = torch.randn(64, 8, generator=gen)
            y = x @ teacher + 0.1 * torch.randn(64, generator=gen)
            if transpose:
                y = y.unsqueeze(1)
            out = model(x)
            pred = out.reshape(y.shape) if squeeze else (out.squeeze(1) if transpose else out)
            loss = loss_fn(pred, y)
            if first is None:
                first = (out.detach().clone(), y.clone(), loss.detach().clone())
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out.squeeze(1) if transpose else out, batch=(x, y))
    return diag, first


def _measured(tmp_path) -> list[dict[str, float]]:
    """The ``loss_shape`` probe's measurements (table ``diag/data/loss_shape``), in step order."""
    return [r.tables["diag/data/loss_shape"] for r in read_records(tmp_path) if "diag/data/loss_shape" in r.tables]


@pytest.mark.parametrize("name", list(LOSSES))
def test_broadcast_loss_is_found_at_its_first_step(tmp_path, name: str) -> None:
    diag, (out, y, loss) = _regression(tmp_path, LOSSES[name])
    got = [a for a in diag.alerts if a.kind == "loss_broadcast"]
    assert len(got) == 1, [(a.kind, a.step) for a in diag.alerts]
    alert = got[0]
    assert alert.step == 0 and alert.severity == "critical" and alert.where == "loss"
    assert "(64, 1)" in alert.message and "(64,)" in alert.message and "4096 pairs" in alert.message
    fn = name.replace("huber", "smooth_l1").replace("mse_sum", "mse")
    said = {"mse": "is MSE", "l1": "is L1", "smooth_l1": "is smooth-L1"}[fn]
    assert said in alert.message and ("reduction='sum'" in alert.message) == (name == "mse_sum"), alert.message
    kept = _measured(tmp_path)[0]  # step 0's measurement: every function both ways, against torch's own
    assert kept["step"] == 0 and kept["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert kept["elements"] == 64 * 64 and kept["aligned_elements"] == 64
    for key, reference in {"mse": F.mse_loss, "l1": F.l1_loss, "smooth_l1": F.smooth_l1_loss}.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            broadcast = reference(out, y)
        assert kept[key] == pytest.approx(broadcast.item(), rel=1e-5), key
        assert kept[f"{key}_aligned"] == pytest.approx(reference(out.squeeze(1), y).item(), rel=1e-5), key
    assert abs(kept[f"{fn}_aligned"] - kept[fn]) > 1e-3 * kept[fn]  # the two readings differ
    assert not [a for a in diag.alerts if a.kind != "loss_broadcast" and a.severity == "critical"]


def test_transposed_pair_is_found(tmp_path) -> None:
    diag, _ = _regression(tmp_path, F.mse_loss, transpose=True)
    got = [a for a in diag.alerts if a.kind == "loss_broadcast"]
    assert [a.step for a in got] == [0] and "(64,)" in got[0].message and "(64, 1)" in got[0].message


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_loss_that_squeezes_the_output_itself_is_silent(tmp_path, level: str) -> None:
    """The shapes handed to step() broadcast, the loss does not: measured (5 checks), nothing said."""
    diag, _ = _regression(tmp_path, F.mse_loss, squeeze=True, steps=120, level=level)
    assert not [a for a in diag.alerts if a.severity != "info"], [(a.kind, a.step, a.message) for a in diag.alerts]
    records = list(read_records(tmp_path))
    assert max(r.scalars.get("diag/data/loss_checks", 0) for r in records) == 5  # the probe did look
    measured = _measured(tmp_path)
    assert len(measured) == 5  # and the loss it was handed is the aligned MSE every time, not the broadcast one
    assert all(m["loss"] == pytest.approx(m["mse_aligned"], rel=1e-6) and m["loss"] != m["mse"] for m in measured)


def test_matched_shapes_and_classification_are_never_measured(tmp_path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="basic", every=10, sinks=["local"],
                                             output_dir=str(tmp_path / "cls"), probes=OFF) as diag:
        for _ in range(30):
            x, y = torch.randn(64, 8, generator=gen), torch.randint(0, 4, (64,), generator=gen)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    assert not diag.alerts or all(a.kind != "loss_broadcast" for a in diag.alerts)
    assert {r.scalars.get("diag/data/loss_checks") for r in read_records(tmp_path / "cls")} == {0.0}
    # regression with matched shapes: (64, 1) against (64, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with one_thread(), trackdiag.Diagnostics(model, opt, level="basic", every=10, sinks=["local"],
                                             output_dir=str(tmp_path / "matched"), probes=OFF) as diag:
        for _ in range(30):
            x = torch.randn(64, 8, generator=gen)
            y = x.sum(1, keepdim=True)
            out = model(x)
            loss = F.mse_loss(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    assert all(a.kind != "loss_broadcast" for a in diag.alerts)
    assert {r.scalars.get("diag/data/loss_checks") for r in read_records(tmp_path / "matched")} == {0.0}


def test_raw_unit_targets_are_confirmed_later_and_dated_from_the_first_step(tmp_path) -> None:
    """Targets in raw units (mean 150, as the diabetes tutorial leaves them) and outputs near 0: at the first steps the
    broadcast and aligned MSE differ by 1e-4 of the loss or less, too little to tell them apart; a later window's
    measurement confirms it, and the alert is dated from the first step the shapes were handed over."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(8, generator=gen)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].weight.mul_(1e-3)  # outputs all but constant at first: no covariance with the targets yet
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(), one_thread(), trackdiag.Diagnostics(
            model, opt, level="basic", every=50, sinks=["local"], output_dir=str(tmp_path), probes=OFF) as diag:
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(160):
            x = torch.randn(32, 8, generator=gen)
            y = 150 + 25 * (x @ teacher)
            out = model(x)
            loss = F.mse_loss(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    got = [a for a in diag.alerts if a.kind == "loss_broadcast"]
    measured = _measured(tmp_path)
    assert [a.step for a in got] == [0] and {m["first"] for m in measured} == {0}, (measured, diag.alerts)
    told = next(r for r in read_records(tmp_path) if any(a.kind == "loss_broadcast" for a in r.alerts))
    assert told.tables["diag/data/loss_shape"]["step"] > 0 == measured[0]["step"]  # confirmed by a later measurement
    assert "since step 0" in got[0].message

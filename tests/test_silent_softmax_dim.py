"""A silent error no issue named: a softmax over the wrong dimension (``softmax_wrong_dim``).

``F.log_softmax(logits, dim=0)`` before ``nll_loss``, ``torch.log(torch.softmax(logits, 0))``, a model ending in
``nn.LogSoftmax(dim=0)`` or ``nn.Softmax(dim=0)``, or ``F.log_softmax(x)`` with no ``dim`` on ``(B, T, C)`` scores (which
picks 0): each class's scores are normalised across the batch instead of across the classes. Nothing crashes, the
model still learns something (a digits MLP: 80 % instead of 88 %), and the loss sits far above 0.

Before: silent (in the loss), ``nll_without_log_softmax`` saying the log-softmax was forgotten (``nn.LogSoftmax(dim=0)``)
or ``not_learning`` with no cause (``nn.Softmax(dim=0)`` then cross-entropy). Now: ``softmax_wrong_dim``, critical, at
step 0, at every preset; the record's cross-entropy along the wrong dimension equals the loss. Healthy twins, silent:
the right dimension said every way (``dim=-1``, ``dim=1``, ``nn.LogSoftmax(dim=1)``, a segmentation map's ``dim=1``,
cross-entropy on logits) and a symmetric contrastive loss that normalises a similarity matrix both ways.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _run(tmp_path, loss_fn: Loss, *, head: nn.Module | None = None, shape: str = "flat", level: str = "advanced",
         steps: int = 40):
    """10-class prototypes plus noise; ``shape``: ``flat`` (N, C) / (N,), ``seq`` (B, T, C) / (B, T), ``seg``
    (N, C, H, W) / (N, H, W), ``pairs`` (N, N) similarities with targets ``arange(N)``; ``head``: the model's last
    module. Returns the session and the first step's (scores, targets, loss)."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    protos = torch.randn(10, 16, generator=gen)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)]
    model = nn.Sequential(*layers, *([head] if head is not None else []))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, every=10, sinks=["local"],
                                             output_dir=str(tmp_path), probes=OFF) as diag:
        for _ in range(steps):
            lead = {"flat": (64,), "seq": (8, 12), "seg": (4, 5, 6), "pairs": (10,)}[shape]
            y = torch.randint(0, 10, lead, generator=gen) if shape != "pairs" else torch.randperm(10, generator=gen)
            x = protos[y] + 0.5 * torch.randn(*lead, 16, generator=gen)
            out = model(x)
            if shape == "seg":
                out = out.permute(0, 3, 1, 2)
            if shape == "pairs":  # each sample's embedding against every class prototype's, scored as (N, N)
                out = out @ model(protos[y]).t()
                y = torch.arange(10)
            loss = loss_fn(out, y)
            if first is None:
                first = (out.detach().clone(), y.clone(), loss.detach().clone())
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag, first


def _loud(diag) -> list:
    return [(a.kind, a.step, a.severity) for a in diag.alerts if a.severity != "info"]


PLANTED: dict[str, tuple[Loss, nn.Module | None, str]] = {
    "log_softmax_dim0_in_loss": (lambda z, y: F.nll_loss(F.log_softmax(z, dim=0), y), None, "flat"),
    "log_of_softmax_dim0": (lambda z, y: F.nll_loss(torch.log(torch.softmax(z, 0)), y), None, "flat"),
    "model_log_softmax_dim0": (F.nll_loss, nn.LogSoftmax(dim=0), "flat"),
    "model_softmax_dim0_then_ce": (F.cross_entropy, nn.Softmax(dim=0), "flat"),
    "implicit_dim_on_3d": (lambda z, y: F.nll_loss(F.log_softmax(z, None, _stacklevel=5).transpose(1, 2), y), None,
                           "seq"),
}


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_softmax_over_the_batch_is_found_at_the_first_step(tmp_path, name: str) -> None:
    loss_fn, head, shape = PLANTED[name]
    with pytest.warns(UserWarning, match="Implicit dimension") if name == "implicit_dim_on_3d" else _nothing():
        diag, (out, y, loss) = _run(tmp_path, loss_fn, head=head, shape=shape)
    found = [a for a in diag.alerts if a.kind == "softmax_wrong_dim"]
    assert [(a.step, a.severity, a.where) for a in found] == [(0, "critical", "loss")], _loud(diag)
    assert _loud(diag)[0][0] == "softmax_wrong_dim", _loud(diag)
    assert not {"nll_without_log_softmax", "softmax_before_ce"} & {k for k, *_ in _loud(diag)}
    assert "dimension 0 (the batch" in found[0].message and "dim=-1" in found[0].hint
    table = next(r.tables["diag/data/loss_form"] for r in read_records(tmp_path) if "diag/data/loss_form" in r.tables)
    assert table["softmax_dim"] == 0 and table["class_dim"] == (2 if shape == "seq" else 1)
    if head is None:  # the loss normalised along dim 0: the record's cross-entropy along it is the loss
        cdim = table["class_dim"]
        reference = F.nll_loss(F.log_softmax(out.double(), dim=0).movedim(int(cdim), 1), y)
        assert table["along"] == pytest.approx(reference.item(), rel=1e-9) == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("level", ["basic", "extreme"])
def test_found_at_every_preset(tmp_path, level: str) -> None:
    diag, _ = _run(tmp_path, PLANTED["log_softmax_dim0_in_loss"][0], level=level)
    assert [(a.kind, a.step) for a in diag.alerts if a.kind == "softmax_wrong_dim"] == [("softmax_wrong_dim", 0)]


HEALTHY: dict[str, tuple[Loss, nn.Module | None, str]] = {
    "cross_entropy_on_logits": (F.cross_entropy, None, "flat"),
    "log_softmax_dim_minus_1": (lambda z, y: F.nll_loss(F.log_softmax(z, dim=-1), y), None, "flat"),
    "model_log_softmax_dim1": (F.nll_loss, nn.LogSoftmax(dim=1), "flat"),
    "sequence_dim_minus_1": (lambda z, y: F.nll_loss(F.log_softmax(z, -1).transpose(1, 2), y), None, "seq"),
    "segmentation_dim1": (lambda z, y: F.nll_loss(F.log_softmax(z, dim=1), y), None, "seg"),
    # CLIP-style: a similarity matrix normalised over rows and over columns, averaged
    "symmetric_contrastive": (lambda z, y: -(F.log_softmax(z, 0).diag().mean() + F.log_softmax(z, 1).diag().mean()) / 2,
                              None, "pairs"),
}


@pytest.mark.parametrize("name", list(HEALTHY))
def test_the_right_dimension_is_silent(tmp_path, name: str) -> None:
    loss_fn, head, shape = HEALTHY[name]
    diag, _ = _run(tmp_path, loss_fn, head=head, shape=shape)
    assert not [a for a in diag.alerts if a.kind == "softmax_wrong_dim"], _loud(diag)
    assert not {"nll_without_log_softmax", "softmax_before_ce"} & {k for k, *_ in _loud(diag)}, _loud(diag)
    if name != "symmetric_contrastive":  # measured, and not flagged
        tables = [r.tables["diag/data/loss_form"] for r in read_records(tmp_path) if "diag/data/loss_form" in r.tables]
        assert tables and all("softmax_dim" not in t for t in tables)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

"""Training data sorted by class and read without shuffling (``class_sorted_batches``).

Planted: the digits training set ordered by label (as ``ImageFolder`` stores it) behind ``DataLoader(shuffle=False)``:
each batch holds one class, class after class. Raised, a warning, at the first logging step whose last 50 batches
qualify, dated at the span's first step; the counts the record keeps equal the ones made from the batches directly.
Two classes sorted (cats, then dogs) too. Healthy twins, silent: the same loader shuffled, imbalanced labels (97 %
one class in batches of 8; 95 % negatives in a binary task), P-K sampling
(4 classes x 8 per batch, metric learning), class-incremental tasks of two classes, InfoNCE's all-zero labels.
"""
from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trackdiag
from _harness import one_thread
from _zoo_a import digits
from trackdiag.core.record import read_records
from trackdiag.probes.data import ONE_CLASS_MIN_BATCH

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
STEPS = 160


def _loop(tmp_path, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], *, steps: int = STEPS,
          level: str = "advanced", classes: int = 10):
    """An MLP classifier on 64 features trained with Adam on ``batches``; returns (session, the labels of every step)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, classes))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen = []
    with one_thread(), trackdiag.Diagnostics(model, opt, level=level, every=10, sinks=["local"],
                                             output_dir=str(tmp_path), probes=OFF) as diag:
        for _, (x, y) in zip(range(steps), batches):
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
            seen.append(y.clone())
    return diag, seen


def _epochs(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    while True:
        yield from loader


def _sorted_digits(shuffle: bool, per_class: int | None = None, classes: int = 10) -> DataLoader:
    xtr, ytr, _, _ = digits()
    if classes < 10:  # cats vs dogs: the first classes only
        keep = ytr < classes
        xtr, ytr = xtr[keep], ytr[keep]
    order = torch.argsort(ytr, stable=True)  # stored class by class, as ImageFolder lists its folders
    if per_class is not None:  # small classes: a batch in three straddles two of them
        order = torch.cat([order[ytr[order] == c][:per_class] for c in range(classes)])
    return DataLoader(TensorDataset(xtr[order], ytr[order]), batch_size=32, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0))


def _loud(diag) -> list[tuple[str, int]]:
    return [(a.kind, a.step) for a in diag.alerts if a.severity != "info"]


@pytest.mark.parametrize("per_class,classes,share", [(None, 10, 0.75), (80, 10, 0.3), (None, 2, 0.75)],
                         ids=["whole", "2.5_batches_a_class", "two_classes"])
def test_sorted_unshuffled_data_is_raised_with_the_counts_the_batches_give(tmp_path, per_class, classes, share) -> None:
    diag, seen = _loop(tmp_path, _epochs(_sorted_digits(shuffle=False, per_class=per_class, classes=classes)))
    found = [a for a in diag.alerts if a.kind == "class_sorted_batches"]
    assert len(found) == 1, diag.alerts
    alert = found[0]
    assert alert.severity == "warning" and alert.where == "input batch", alert
    records = list(read_records(tmp_path))
    raised = next(r.step for r in records if any(a.kind == "class_sorted_batches" for a in r.alerts))
    assert raised <= 60 and alert.step <= 10, (raised, alert.step)  # the first logging step with 50 batches judged
    assert "shuffle=True" in alert.hint and "sorted by label" in alert.message, alert.message

    # the probe's counts against the labels themselves (a batch under 8 samples, an epoch's last, is not counted)
    counted = [y for y in seen if len(y) >= ONE_CLASS_MIN_BATCH]
    one_class = [int(y[0]) for y in counted if bool((y == y[0]).all())]
    assert sum(r.scalars.get("diag/data/label_batches", 0.0) for r in records) == len(counted) >= 0.9 * len(seen)
    assert sum(r.scalars.get("diag/data/one_class_batches", 0.0) for r in records) == len(one_class)
    per_class: dict[str, float] = {}
    for r in records:
        for k, v in r.tables.get("diag/data/one_class_labels", {}).items():
            per_class[k] = per_class.get(k, 0.0) + v
    assert per_class == {str(c): float(one_class.count(c)) for c in set(one_class)}
    assert len(one_class) >= share * len(counted)  # what makes it sorted: one batch straddles each border


def test_the_same_data_shuffled_is_silent(tmp_path) -> None:
    diag, seen = _loop(tmp_path, _epochs(_sorted_digits(shuffle=True)))
    assert _loud(diag) == [], diag.alerts
    records = list(read_records(tmp_path))
    assert sum(r.scalars.get("diag/data/label_batches", 0.0) for r in records) == len(seen)  # measured, not skipped


def _batches(make) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    protos = torch.randn(10, 64, generator=gen)
    step = 0
    while True:
        y = make(step, gen)
        yield protos[y] + 0.5 * torch.randn(len(y), 64, generator=gen), y
        step += 1


def _imbalanced(step: int, gen: torch.Generator) -> torch.Tensor:  # 97 % class 0, 1.5 % each of 1 and 2
    u = torch.rand(8, generator=gen)
    return torch.where(u < 0.97, 0, torch.where(u < 0.985, 1, 2))


def _binary_imbalanced(step: int, gen: torch.Generator) -> torch.Tensor:  # 95 % negatives (batches of 8: 66 % all 0)
    return (torch.rand(8, generator=gen) > 0.95).long()


def _pk(step: int, gen: torch.Generator) -> torch.Tensor:  # P=4 classes x K=8 samples (batch-hard triplet mining)
    return torch.randperm(10, generator=gen)[:4].repeat_interleave(8)


def _incremental(step: int, gen: torch.Generator) -> torch.Tensor:  # tasks of two classes, 40 steps each
    pair = 2 * ((step // 40) % 5)
    return pair + torch.randint(0, 2, (32,), generator=gen)


def _all_zero(step: int, gen: torch.Generator) -> torch.Tensor:  # InfoNCE as cross-entropy: the positive at 0
    return torch.zeros(32, dtype=torch.long)


@pytest.mark.parametrize("make", [_imbalanced, _binary_imbalanced, _pk, _incremental, _all_zero],
                         ids=["imbalanced", "binary_imbalanced", "p_k_sampling", "class_incremental", "all_zero_labels"])
def test_batches_of_one_class_by_design_or_chance_are_silent(tmp_path, make) -> None:
    diag, seen = _loop(tmp_path, _batches(make))
    assert not [a for a in diag.alerts if a.kind == "class_sorted_batches"], diag.alerts
    records = list(read_records(tmp_path))
    one_class = sum(bool((y == y[0]).all()) for y in seen)
    assert sum(r.scalars.get("diag/data/one_class_batches", 0.0) for r in records) == one_class

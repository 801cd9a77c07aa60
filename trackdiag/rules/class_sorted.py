"""``class_sorted_batches``: the training batches each hold one class, class after class: data sorted by label and
read without shuffling (keys of the ``data_labels`` probe)."""
from __future__ import annotations

import collections
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule


class ClassSortedBatches(Rule):
    """Fires when, over the last ``min_batches`` (50) or more batches of one label per sample (targets ``(B,)`` with
    ``B >= 8`` against class scores ``(B, C)``), at least ``share`` (50 %) hold a single class, and ``min_classes`` (2)
    classes each make up 5 % or more of those: the stream walks through the classes one after another (a class of
    ``k`` batches gives ``(k - 1) / k`` of them: one batch straddles each border; classes smaller than two batches
    are not seen). The classic
    cause: a dataset stored class by class (``ImageFolder``, a concatenation of per-class files) read with
    ``shuffle=False``, or a sampler that yields the indices in order. The model chases the current class and forgets
    the others; the training loss can look fine while validation sits near chance.

    Silent by construction for what is not sorted data: a batch of several classes is never counted (P-K sampling
    for metric learning, class-incremental tasks of two or more classes, replay), nor are imbalanced labels (a
    majority class alone in most batches is one class: a minority class alone in a batch of 8 is a 1e-5 chance at a
    share of 25 %), one-class targets (InfoNCE's all-zero labels),
    batches under 8 samples and per-token targets. ``step``: the first step of the judged span; ``persistent`` (a
    warning). Once per run."""

    kind = "class_sorted_batches"
    hint = ("The training data reach the model sorted by class: each batch holds one label. Pass shuffle=True to the "
            "training DataLoader (or a RandomSampler; DistributedSampler shuffles by default, with set_epoch each "
            "epoch). If one class per batch is intended (class-incremental learning), disable this rule: "
            "diag.rules.class_sorted_batches.enabled=false.")

    def __init__(self, *, share: float = 0.5, min_batches: int = 50, min_classes: int = 2, **kw: Any) -> None:
        super().__init__(**kw)
        self.share, self.min_batches, self.min_classes = share, max(2, min_batches), max(2, min_classes)
        self._span: list[tuple[int, float, float, dict[str, float]]] = []  # (step, batches, one-class, per class)
        self._fired = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        batches = record.scalars.get("diag/data/label_batches", 0.0)
        if self._fired or not batches:
            return []
        single = record.scalars.get("diag/data/one_class_batches", 0.0)
        self._span.append((record.step, batches, single, dict(record.tables.get("diag/data/one_class_labels", {}))))
        while len(self._span) > 1 and sum(b for _, b, _, _ in self._span[1:]) >= self.min_batches:
            self._span.pop(0)  # the shortest recent span of at least min_batches batches
        total = sum(b for _, b, _, _ in self._span)
        singles = sum(s for _, _, s, _ in self._span)
        if total < self.min_batches or singles < self.share * total:
            return []
        per_class: collections.Counter[str] = collections.Counter()
        for *_, counts in self._span:
            per_class.update(counts)
        major = sorted((c for c, n in per_class.items() if n >= 0.05 * singles), key=lambda c: -per_class[c])
        if len(major) < self.min_classes:
            return []
        self._fired = True
        start = self._span[0][0]
        msg = (f"{int(singles)} of the {int(total)} training batches from step {start} to {record.step} each hold a "
               f"single class, {len(per_class)} classes one after another (most: "
               f"{', '.join(f'{c} x{int(per_class[c])}' for c in major[:4])}): the data are sorted by label and not "
               f"shuffled.")
        return [self.make(start, msg, singles / total, self.share, "input batch", ["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired": self._fired, "span": self._span}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired = bool(state.get("fired", False))
        self._span = [(int(s), float(b), float(n), dict(c)) for s, b, n, c in state.get("span", [])]

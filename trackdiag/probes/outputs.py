"""Output-diversity probe (mode collapse), from the ``outputs`` passed to ``Diagnostics.step``.

On due steps only, per component (``outputs`` may be a dict keyed by component names), from one
floating tensor picked out of the outputs (option ``key``: a dict key, attribute name or index;
default: the first floating tensor found in a tensor, tuple/list, dict or dataclass-like object),
emits, on the first ``max_samples`` (256) rows of the batch:

  ``diag/[<c>/]out/batch_std``: mean over features of the std across the batch (0 = constant output),
      on at most ``max_features`` (1024) evenly strided features;
  ``diag/[<c>/]out/pairwise_dist``: mean L2 distance between distinct samples (``torch.cdist`` on the
      first 64 rows, same features);
  ``diag/[<c>/]out/scale``: the mean absolute output (what ``batch_std`` is judged against);
  ``diag/[<c>/]out/samples``: the number of rows the statistics saw;
  for classifiers (``classifier: true``, or auto: 2-D logits with >= 2 columns while the ``batch``
  passed to ``step`` holds an integer label tensor of shape (N,); auto-detection stays off for
  generators/autoencoders/regressors with flat outputs, whose "argmax" means nothing):
  ``diag/[<c>/]out/pred_entropy``: mean entropy of the softmax, in nats;
  ``diag/[<c>/]out/top_class_fraction``: fraction of the batch predicting the most frequent class;
  ``diag/[<c>/]out/label_top_fraction``: with the labels in the batch, the share of its most frequent label over
  the same rows (a classifier of rare positives predicts the majority class for as many rows as there are);
  ``diag/[<c>/]out/classes``: the number of logit columns.

Cost on a due step, bounded whatever the output size: a float copy of at most 256 x 1024 values, a
``cdist`` of 64 x 64 rows of 1024 features and, for classifiers, a softmax and a class count
(``scatter_add_``) over at most 256 rows of logits; all on device, read with the other diagnostics.
Nothing at all on other steps (no reference to the outputs is kept).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe, take_pending
from trackdiag.util.norms import bin_counts

_MAX_DEPTH = 4
_PAIR_ROWS = 64  # rows for the pairwise distances (64 x 64 distances)


def first_float_tensor(obj: Any, depth: int = 0) -> torch.Tensor | None:
    """The first floating-point tensor in ``obj`` (depth-first through containers), or None."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return None
    if isinstance(obj, Mapping):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
        children = list(vars(obj).values())
    else:
        return None
    for child in children:
        found = first_float_tensor(child, depth + 1)
        if found is not None:
            return found
    return None


def pick_output(obj: Any, key: str | int | None) -> torch.Tensor | None:
    """The tensor ``key`` names in ``obj`` (dict key, attribute or index), else the first floating one."""
    if key is not None:
        if isinstance(obj, Mapping):
            obj = obj.get(key)
        elif isinstance(key, int) and isinstance(obj, (list, tuple)):
            obj = obj[key] if -len(obj) <= key < len(obj) else None
        else:
            obj = getattr(obj, str(key), None)
    return first_float_tensor(obj)


def has_labels(batch: Any, n: int, depth: int = 0) -> bool:
    """Whether ``batch`` holds an integer tensor of shape (n,) (class labels). Host-only."""
    return labels_in(batch, n) is not None


def labels_in(batch: Any, n: int, depth: int = 0) -> torch.Tensor | None:
    """The first integer tensor of shape (n,) in ``batch`` (class labels), or None. Host-only."""
    if isinstance(batch, torch.Tensor):
        ok = batch.ndim == 1 and batch.shape[0] == n and not batch.is_floating_point() and batch.dtype != torch.bool
        return batch if ok else None
    if depth >= 2:
        return None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for b in batch:
            got = labels_in(b, n, depth + 1)
            if got is not None:
                return got
    return None


@torch.no_grad()
def label_top_fraction(labels: torch.Tensor, classes: int, max_samples: int) -> torch.Tensor:
    """The share of the most frequent class among the first ``max_samples`` labels (device; labels outside
    ``[0, classes)``, padding, count for none)."""
    y = labels.detach()[:max_samples].long()
    valid = (y >= 0) & (y < classes)
    counts = torch.zeros(classes, dtype=torch.long, device=y.device).scatter_add_(0, y.clamp(0, classes - 1), valid.long())
    return counts.max().float() / valid.sum().clamp(min=1).float()


def split_by_component(outputs: Any, names: list[str]) -> dict[str, Any]:
    """``{component: outputs}``: a dict keyed by (a subset of) the named components is split."""
    named = {n for n in names if n}
    if isinstance(outputs, Mapping) and outputs and named and set(outputs) <= named:
        return dict(outputs)
    return {"": outputs}


@torch.no_grad()
def output_stats(x: torch.Tensor, classifier: bool, max_samples: int, max_features: int) -> dict[str, Any]:
    """Device statistics of a batch of outputs (see module docstring); {} for fewer than 2 samples."""
    if x.ndim == 0 or x.shape[0] < 2:
        return {}
    rows = x.detach()[:max_samples]
    m = int(rows.shape[0])
    rows = rows.reshape(m, -1)  # a view, or a copy of at most max_samples rows
    stride = max(1, -(-rows.shape[1] // max_features))
    sub = rows[:, ::stride].float()
    out: dict[str, Any] = {"batch_std": sub.std(dim=0).mean(), "scale": sub.abs().mean(), "samples": float(m)}
    pts = sub[:_PAIR_ROWS]
    out["pairwise_dist"] = torch.cdist(pts, pts).sum() / (pts.shape[0] * (pts.shape[0] - 1))
    if classifier and rows.shape[1] >= 2:
        logp = rows.float().log_softmax(dim=1)
        out["pred_entropy"] = -(logp.exp() * logp).sum(dim=1).mean()
        counts = bin_counts(logp.argmax(dim=1), rows.shape[1])
        out["top_class_fraction"] = counts.max().float() / m
        out["classes"] = float(rows.shape[1])
    return out


class OutputProbe(Probe):
    """See module docstring.

    Args:
        key: which tensor of the outputs to measure (dict key, attribute name or index).
        classifier: treat the tensor as class logits (None: auto, 2-D with >= 2 columns and labels in the batch).
        max_samples / max_features: rows / strided features the statistics use.
    """

    name = "outputs"

    def __init__(self, *, enabled: bool = True, every: int | None = None, key: str | int | None = None,
                 classifier: bool | None = None, max_samples: int = 256, max_features: int = 1024) -> None:
        super().__init__(enabled=enabled, every=every)
        if max_samples < 2 or max_features < 1:
            raise ConfigError([f"diag.probes.outputs: max_samples must be >= 2 and max_features >= 1, "
                               f"got {max_samples} and {max_features}"])
        self.key, self.classifier = key, classifier
        self.max_samples, self.max_features = max_samples, max_features
        self._pending: dict[str, dict[str, Any]] = {}

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if inputs.outputs is None or not ctx.is_due(self.schedule):
            return
        for comp, obj in split_by_component(inputs.outputs, [c.name for c in ctx.components]).items():
            t = pick_output(obj, self.key)
            if t is not None:
                cls = self.classifier
                labels = labels_in(inputs.batch, t.shape[0]) if t.ndim == 2 and t.shape[1] >= 2 else None
                if cls is None:
                    cls = labels is not None
                stats = output_stats(t, cls, self.max_samples, self.max_features)
                if stats and cls and labels is not None and "top_class_fraction" in stats:
                    stats["label_top_fraction"] = label_top_fraction(labels, t.shape[1], self.max_samples)
                if stats:
                    self._pending[comp] = stats

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        return take_pending(self._pending)

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for name, v in values.items():
            comp, _, stat = name.partition("|")
            record.scalars[f"diag/{comp}/out/{stat}" if comp else f"diag/out/{stat}"] = float(v[0])

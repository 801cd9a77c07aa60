"""Loss probe: every step's loss value, kept on device between logging steps.

Emits, per loss name (``loss`` or ``<component>/loss``):
  series ``diag/[<c>/]loss``: the value at every step (full resolution, no per-step host sync);
  ``diag/[<c>/]loss/ema``: EMA of the finite values;
  ``diag/[<c>/]loss/nonfinite_steps``: non-finite values in the window since the last log;
  ``diag/data/num_classes`` at the first logging steps, when ``step(outputs=..., batch=...)`` shows a
  classification-shaped output (class scores and integer targets that pair up);
  ``diag/task/kind`` (1 classification, 2 regression, 3 binary/multi-label BCE, 0 not shown),
  ``diag/task/chance_loss`` (the loss of a model that ignores its input: ln C, ln 2 for BCE, or the
  targets' variance for MSE; times the targets for a summed loss), ``diag/task/marginal_entropy`` and
  ``diag/task/majority_share`` (the label frequencies' entropy, for BCE the mean H(p_j) of the labels) and ``diag/task/shift`` (1: the loss compares position t with target t+1), ``diag/task/sequence`` (1: a target per position)
  and ``diag/task/next_token`` (1: the targets are the input tokens shifted by one: a language model), once the
  task is shown (see :mod:`trackdiag.alerts.task`): the first steps' loss equals the outputs'
  cross-entropy (or MSE) against the batch's targets. Task-specific rules read these.
Cost: one ``detach`` per step and loss (a reference is kept, nothing is copied); at the logging
step the window is stacked and copied to the host with every other diagnostic. During the first 3
steps only: the class count from shapes and one cross-entropy (or MSE) of the outputs on the device.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from trackdiag.alerts.marginal import Marginal, entropy
from trackdiag.alerts.task import STEPS, Task, decide, per_position, terms
from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.norms import cat_chunks, stack_scalars
from trackdiag.util.stats import Ema
from trackdiag.util.tensors import class_dim, logits_of, targets_of


def classes_of(outputs: Any, batch: Any) -> int:
    """The number of classes of a classification-shaped output (shapes only, no device work), or -1."""
    t = targets_of(batch)
    logits = logits_of(outputs) if t is not None else None
    dim = class_dim(logits, t) if logits is not None and t is not None else None
    return int(logits.shape[dim]) if dim is not None and logits is not None else -1


#: a model's own predictions as its targets: every one of at least this many targets equal to the argmax of the
#: outputs, at a loss of at least this share of the chance level (a trained model agrees with its labels at a loss
#: near 0; one at chance agrees with real labels on about 1/C of them)
OWN_MIN_TARGETS, OWN_AT_CHANCE = 16, 0.5


def own_predictions(task: Task, got: dict[str, float]) -> bool:
    """Whether a step's class targets are the outputs' own predictions (``targets_from_outputs``): all of them (16+)
    equal to the argmax of the outputs, more than one class predicted, and the loss still at half the chance level
    or more."""
    return (task.kind == "classification" and got.get("agree") == 1.0 and got.get("spread", 0.0) > 0
            and got.get("n", 0.0) >= OWN_MIN_TARGETS and got.get("ce", 0.0) >= OWN_AT_CHANCE * math.log(max(task.classes, 2)))


def _stacked(values: list[Any]) -> torch.Tensor:
    """Per-step losses as one 1-D tensor: fp32 on their device when all are tensors, else fp64 host floats."""
    if all(isinstance(v, torch.Tensor) for v in values):
        return stack_scalars(values)
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


class _Ring:
    """Per-step values of one loss between two logging steps: detached references, not copies
    (one ``detach`` per step), stacked into one tensor at the logging step. The cost budget's window checks
    between stretched logging steps stack what came since the last check (:meth:`fold`); the logging step
    reuses those chunks, so every value is stacked once."""

    def __init__(self) -> None:
        self.values: list[Any] = []  # since the last fold
        self.steps: list[int] = []  # the whole window's
        self.folded: list[torch.Tensor] = []  # 1-D fp32 chunks of the window's earlier values (fold)

    def fold(self) -> torch.Tensor | None:
        """The values since the last fold as one 1-D tensor (:func:`_stacked`), kept for :meth:`take`; None when
        there are none."""
        if not self.values:
            return None
        chunk = _stacked(self.values)
        self.folded.append(chunk)
        self.values = []
        return chunk

    def take(self) -> tuple[list[int], torch.Tensor]:
        steps, values, folded = self.steps, self.values, self.folded
        stacked = cat_chunks([*folded, _stacked(values)] if values else folded)
        self.steps, self.values, self.folded = [], [], []  # last: a Ctrl-C in the stacking leaves the ring whole for close()
        return steps, stacked


class LossProbe(Probe):
    """See module docstring. Args: ``ema_beta`` smoothing of ``loss/ema``."""

    name = "loss"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, ema_beta: float = 0.98) -> None:
        super().__init__(enabled=enabled, every=every)
        self.ema_beta = ema_beta
        self._rings: dict[str, _Ring] = {}
        self._emas: dict[str, Ema] = {}
        self._classes = -1
        self.task = Task()
        self._task_seen: list[tuple[int, bool, Any, list[str], list[Any]]] = []  # (step, accumulated, loss, names, terms)
        self._task_taken: list[tuple[int, bool, list[str]]] = []
        self._task_steps = 0
        self._task_classes = -1
        self._task_sequence = False
        self._marginal = Marginal()
        self._entropy: tuple[float, float] | None = None
        self._task_told = False
        self._told_own = -1  # the step whose targets were shown to be the outputs' own predictions (own_predictions)
        self._phase = 0

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if ctx.phase != self._phase:  # a new training phase may train another task: show it again
            self._phase, self.task, self._task_steps, self._task_told = ctx.phase, Task(), 0, False
            self._marginal, self._entropy = Marginal(), None
        marginal = self._marginal  # done: its property not asked again on every step
        if not marginal.done and marginal.wants and inputs.outputs is not None and inputs.batch is not None \
                and len(inputs.losses) == 1:
            marginal.add(inputs.outputs, inputs.batch)
        if self._task_steps < STEPS and inputs.outputs is not None and inputs.batch is not None:
            self._task_steps += 1
            if self._classes < 0:
                self._classes = classes_of(inputs.outputs, inputs.batch)
            loss = inputs.losses.get("") if len(inputs.losses) == 1 else None
            got = terms(inputs.outputs, inputs.batch) if isinstance(loss, torch.Tensor) and self.task.kind == "unknown" else None
            if got:
                names = list(got)
                accumulated = max(ctx.passes.values(), default=1) > 1
                self._task_seen.append((ctx.step, accumulated, loss.detach(), names, [got[k] for k in names]))
                self._task_classes = classes_of(inputs.outputs, inputs.batch)
                self._task_sequence = per_position(inputs.batch)
        for name, value in inputs.losses.items():
            if value is None:
                continue
            ring = self._rings.get(name)
            if ring is None:
                ring = self._rings[name] = _Ring()
                self._emas[name] = Ema(self.ema_beta)
            ring.values.append(value.detach() if isinstance(value, torch.Tensor) else float(value))
            ring.steps.append(ctx.step)

    def window_values(self) -> dict[str, list[Any]]:
        """Each loss's values since the last call or logging step (the cost budget's check between stretched
        ones): one 1-D tensor each, kept for the logging step (:meth:`_Ring.fold`)."""
        return {f"loss:{name}": [chunk] for name, ring in self._rings.items() if (chunk := ring.fold()) is not None}

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        out: dict[str, Any] = {}
        self._steps: dict[str, list[int]] = {}
        for name, ring in self._rings.items():
            if ring.steps:
                self._steps[name], out[name] = ring.take()
        self._task_taken = []
        for i, (step, acc, loss, names, vals) in enumerate(self._task_seen):
            out[f"\ttask{i}"] = stack_scalars([loss, *vals], torch.float64)
            self._task_taken.append((step, acc, names))
        self._task_seen = []
        counts = self._marginal.take(self.task.soft)
        if counts is not None:
            out["\tmarginal"] = counts
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for i, (step, acc, names) in enumerate(self._task_taken):
            got = values.pop(f"\ttask{i}", None)
            if got is not None and self.task.kind == "unknown":
                host = got.reshape(-1).tolist()
                terms_ = dict(zip(names, host[1:]))
                self.task = decide(host[0], terms_, self._task_classes, acc, self._task_sequence)
                if self._told_own < 0 and own_predictions(self.task, terms_):
                    self._told_own = step
                    record.scalars["diag/task/targets_from_outputs"] = float(step)
                    record.scalars["diag/task/targets_agree"] = terms_["agree"]
                    record.scalars["diag/task/targets_n"] = terms_["n"]
        self._task_taken = []
        counts = values.pop("\tmarginal", None)
        if counts is not None:
            self._entropy = entropy(counts.reshape(-1, 2) if self._marginal.binary else counts.reshape(-1))
        if self.task.kind in ("classification", "binary") and self._entropy is not None:  # once: rules keep it
            record.scalars["diag/task/marginal_entropy"], record.scalars["diag/task/majority_share"] = self._entropy
            self._entropy = None
        if self.task.kind != "unknown" and not self._task_told:
            self._task_told = True
            record.scalars["diag/task/kind"] = {"classification": 1.0, "regression": 2.0, "binary": 3.0}[self.task.kind]
            if self.task.kind == "binary":  # the label prior's entropy and majority share, from the step that showed it
                record.scalars["diag/task/marginal_entropy"] = self.task.prior
                record.scalars["diag/task/majority_share"] = self.task.majority
            record.scalars["diag/task/chance_loss"] = self.task.chance
            record.scalars["diag/task/shift"] = float(self.task.shift)
            record.scalars["diag/task/summed"] = float(self.task.reduction == "sum")
            record.scalars["diag/task/sequence"] = float(self.task.sequence)
            record.scalars["diag/task/next_token"] = float(self.task.next_token)
        for name, vals in values.items():
            key = f"diag/{name}/loss" if name else "diag/loss"
            steps = self._steps[name]
            ema = self._emas[name]
            points = [(s, float(v)) for s, v in zip(steps, vals.tolist())]
            for _, v in points:
                ema.update(v)
            record.series[key] = points
            record.scalars[f"{key}/ema"] = ema.value
            record.scalars[f"{key}/nonfinite_steps"] = float(sum(not math.isfinite(v) for _, v in points))
        if self._classes >= 2 and ctx.step < 20:
            record.scalars.setdefault("diag/data/num_classes", float(self._classes))

    def state_dict(self) -> dict[str, Any]:
        return {"emas": {k: e.state_dict() for k, e in self._emas.items()}, "task": vars(self.task)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "task" in state:
            self.task = Task(**state["task"])
            self._task_steps = STEPS
        for k, s in state.get("emas", {}).items():
            self._emas.setdefault(k, Ema(self.ema_beta)).load_state_dict(s)
            self._rings.setdefault(k, _Ring())

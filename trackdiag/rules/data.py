"""Data rules: ``nonfinite_input``, ``constant_inputs``, ``label_range``, ``data_bottleneck``.

They read the keys of the ``data_finite``, ``data_labels`` and ``data_wait`` probes."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from trackdiag.capture.components import stepped_inputs
from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.forensics.replay_hints import STEPPED_INPUT
from trackdiag.rules.base import Rule, loss_series


class NonfiniteInput(Rule):
    """Fires at the exact first step whose batch held a NaN/Inf; ``where`` names the batch entry
    (``input batch[0]``, ``input batch['image']``). ``unambiguous`` unless the loop shows it handles them:
    the loss and the pre-clip gradient norm stayed finite at every step since (missing labels marked NaN and
    masked out of the loss, as torchxrayvision's and MoleculeNet's multi-task loaders do; features imputed
    inside the model): then an ``info`` finding."""

    kind = "nonfinite_input"
    hint = ("The data itself holds NaN/Inf: check the preprocessing (division by a zero std, log of 0, "
            "corrupt files, missing values), add a dataset-level assert or torch.nan_to_num, and drop the bad samples.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        first = record.scalars.get("diag/data/nonfinite_first_step", -1.0)
        if first < 0:
            return []
        firsts = record.tables.get("diag/data/nonfinite_first", {})
        entry = min(firsts, key=lambda k: firsts[k]) if firsts else "batch"
        n = record.scalars.get("diag/data/nonfinite_tensors", 1.0)
        what = "the batch" if entry == "batch" else entry
        msg = f"{what} passed to step() holds NaN/Inf at step {int(first)} ({int(n)} tensor-step(s) with NaN/Inf in this window)."
        if any(stepped_inputs(c) for c in components):  # style transfer, feature visualisation: the batch is stepped
            msg += (" The optimizer steps an input, not the model's parameters: a step too large wrote it, "
                    "the data did not bring it.")
            return [dataclasses.replace(self.make(int(first), msg, n, 0, f"input {entry}", ["unambiguous"]),
                                        hint=STEPPED_INPUT)]
        if _handled(record, components, int(first)):
            msg += (" The loss and the gradients stayed finite: the loop masks or imputes them (missing labels marked "
                    "NaN and left out of the loss). Nothing to do if that is intended.")
            return [self.make(int(first), msg, n, 0, f"input {entry}", [])]
        return [self.make(int(first), msg, n, 0, f"input {entry}", ["unambiguous"])]


def _handled(record: Record, components: Sequence[Component], since: int) -> bool:
    """Whether the loss and the pre-clip global gradient norm were measured and finite at every step from
    ``since`` on in this record's window (a NaN that reached the model or the loss shows in one of them)."""
    series = [*loss_series(record).values(), *(record.series.get(c.key("grad/global_norm"), []) for c in components)]
    seen = [v for pts in series for s, v in pts if s >= since]
    return bool(seen) and all(math.isfinite(v) for v in seen) and any(s == since for pts in series for s, _ in pts)


class ConstantInputs(Rule):
    """Fires when the model input passed to ``step(batch=...)`` held one value everywhere (``diag/data/
    inputs_constant_steps``: its minimum equal to its maximum, the same value step after step) for ``patience`` (20)
    steps in a row: every sample looks the same to the model, so it can learn no more than the average target. The
    usual causes turn real data into zeros: an integer division or cast in the preprocessing (``uint8 // 255``,
    ``(x / 255).astype(np.uint8)``, ``.long()`` after normalising), a mask or dropout that zeroes the input, a
    loader that returns a placeholder for images it failed to read. Not fired where the optimizer steps the input
    (style transfer: the batch is what trains), nor for a loss that is not minimised (``objective``: rl, adversarial:
    a bandit's policy sees one state by design). ``step``: the first of those steps; ``persistent`` (a warning).
    Fires again only for a new run of constant inputs."""

    kind = "constant_inputs"
    hint = ("Every sample reaches the model as the same values: look at one batch (x.min(), x.max(), x[0]) right "
            "where the loop hands it over and walk back through the preprocessing. Divide as floats (x.float() / 255, "
            "not x // 255), do not cast normalised values back to an integer type, check masks and dropout on the "
            "input, and make the dataset raise on a sample it cannot read instead of returning zeros.")

    def __init__(self, *, patience: int = 20, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience = max(1, patience)
        self._fired_first = -2

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        steps = record.scalars.get("diag/data/inputs_constant_steps", 0.0)
        first = int(record.scalars.get("diag/data/inputs_constant_first_step", -1.0))
        if steps < self.patience or first < 0 or first == self._fired_first:
            return []
        if any(stepped_inputs(c) for c in components) or not self.minimised(""):
            return []  # the batch is what the optimizer steps; a policy on one state (a bandit) is fed one by design
        self._fired_first = first
        entry, value = next(iter(record.tables.get("diag/data/inputs_constant", {"batch": math.nan}).items()))
        what = "the batch" if entry == "batch" else entry
        held = "zero" if value == 0 else f"{value:g}"
        msg = (f"{what} passed to step() is {held} in every position at {int(steps)} consecutive steps from step {first}: "
               f"the model sees every sample as the same input, so it can learn no more than the average target "
               f"(the label frequencies of a classifier).")
        return [self.make(first, msg, value, math.nan, f"input {entry}", ["persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"fired_first": self._fired_first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._fired_first = int(state.get("fired_first", -2))


class LabelRange(Rule):
    """Fires at the first step whose class targets fall outside ``[0, num_classes)`` of the model's
    output (``ignore_index`` excluded). Cross-entropy on CUDA turns this into a device-side assert,
    on CPU into an IndexError, or silently into wrong training when the labels are shifted."""

    kind = "label_range"
    hint = ("Labels must be class indices 0..C-1: remap 1-based labels (y - 1), make the output layer as wide "
            "as the number of classes, or set ignore_index for padding labels.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        first = record.scalars.get("diag/data/label_first_bad_step", -1.0)
        if first < 0:
            return []
        lo, hi = record.scalars.get("diag/data/label_min", 0.0), record.scalars.get("diag/data/label_max", 0.0)
        c = int(record.scalars.get("diag/data/num_classes", -1))
        value, limit = (lo, 0) if lo < 0 else (hi, c - 1)
        msg = (f"class targets range over [{int(lo)}, {int(hi)}] but the output has {c} classes (valid: 0..{c - 1}); "
               f"{int(record.scalars.get('diag/data/label_bad_steps', 1))} step(s) in this window.")
        return [self.make(int(first), msg, value, limit, "targets", ["unambiguous"])]


class LabelLeak(Rule):
    """The targets equal the inputs (``diag/data/target_is_input`` >= ``threshold``, 0.99) AND the
    loss is the one of copying them: it follows the cross-entropy of the outputs against the targets
    as they are (``copy``: within a quarter of the gap) rather than against the targets one position
    on (``next``), with ``copy`` below ``next`` by at least ``margin`` (0.05) x ln(C). Targets equal
    to the inputs alone are no leak: models that shift labels inside ``forward`` take them so
    (Hugging Face's ``model(input_ids, labels=input_ids)``), and their loss is ``next``; nor in a model whose
    call is also fed the targets shifted right (``teacher``: an encoder-decoder's teacher-forced decoder input),
    where a source equal to its targets is a copy task (the Annotated Transformer's first example).
    ``unambiguous`` once shown; ``step`` is the first step the targets equalled the inputs."""

    kind = "label_leak"
    hint = ("The targets are the inputs and the model learns to copy them. For next-token prediction take "
            "x = tokens[:, :-1], y = tokens[:, 1:] (or shift inside the loss); check that the label column is "
            "not the input column.")

    def __init__(self, *, threshold: float = 0.99, margin: float = 0.05, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.margin = threshold, margin
        self._first = -1
        self._done = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        share = record.scalars.get("diag/data/target_is_input", -1.0)
        if share >= self.threshold and self._first < 0:
            self._first = int(record.tables.get("diag/data/target_is_input", {}).get("step", record.step))
        ce = record.tables.get("diag/data/leak_ce")
        classes = record.scalars.get("diag/data/num_classes", -1.0)
        if self._done or self._first < 0 or not ce or classes < 2:
            return []
        copy, nxt, loss = ce["copy"], ce["next"], ce["loss"]
        teacher = ce.get("teacher", 0.0)
        if teacher < 0 or teacher >= self.threshold:  # not seen yet, or fed the targets shifted right: copying is its task
            return []
        gap = nxt - copy
        if not (gap >= self.margin * math.log(classes) and abs(loss - copy) < 0.25 * gap):
            return []
        self._done = True
        msg = (f"the targets equal the inputs (from step {self._first}) and the model learns to copy them: at step "
               f"{int(ce['step'])} its loss {loss:.3g} follows the cross-entropy against the inputs themselves "
               f"({copy:.3g}), not against the next token ({nxt:.3g}).")
        return [self.make(self._first, msg, copy, nxt - self.margin * math.log(classes), "targets", ["unambiguous"])]


class TargetsFromOutputs(Rule):
    """The class targets handed to ``step(batch=...)`` are the model's own predictions: at a first step (while the
    loss probe reads the task off the outputs, ``diag/task/targets_from_outputs``) every one of them (16 or more)
    equalled the argmax of the outputs, more than one class was predicted, and the loss was still at half the
    chance level or more. A model at its start agrees with real labels on about 1/C of them, a trained one at a
    loss near 0; agreeing on all of them while unsure is what ``y = out.argmax(1)`` gives (a typo, or pseudo-labels
    taken from the same forward pass they train): the loss then falls fast and teaches the model nothing but to
    agree with itself. ``unambiguous``; ``step`` is that step. Once per run."""

    kind = "targets_from_outputs"
    hint = ("The loss compares the outputs with targets computed from those same outputs. Use the dataset's labels "
            "(the batch's y, not outputs.argmax(1)); for pseudo-labels take them from a separate no-grad forward (a "
            "weak augmentation, an EMA teacher) and keep the confident ones only (FixMatch, Noisy Student).")

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._done = False

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        step = record.scalars.get("diag/task/targets_from_outputs")
        if self._done or step is None:
            return []
        self._done = True
        n = int(record.scalars.get("diag/task/targets_n", 0.0))
        chance = record.scalars.get("diag/task/chance_loss", math.nan)
        msg = (f"at step {int(step)} all {n} class targets passed to step() equal the model's own prediction (the "
               f"argmax of its outputs) while its loss is still near chance (ln C = {chance:.3g}): the targets are "
               f"computed from the outputs, so the loss only teaches the model to agree with itself.")
        return [self.make(int(step), msg, 1.0, 1.0, "targets", ["unambiguous"])]


class DataBottleneck(Rule):
    """Fires when the loop waits for data more than ``threshold`` (0.5) of its wall time, summed
    over the last ``window`` (3) logging steps, once ``min_batches`` (20) batches were timed in that
    window. Needs ``diag.wrap_loader(loader)``."""

    kind = "data_bottleneck"
    hint = ("The GPU/CPU waits for data: raise DataLoader num_workers, set pin_memory=True and "
            "persistent_workers=True, prefetch_factor, move decoding/augmentation off the main process or to the GPU, "
            "cache decoded samples.")

    def __init__(self, *, threshold: float = 0.5, window: int = 3, min_batches: int = 20, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.window, self.min_batches = threshold, window, min_batches

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        if "diag/data/wait_share" not in record.scalars:
            return []
        recent = [r for r in [*history, record] if "diag/data/wait_share" in r.scalars][-self.window:]
        batches = sum(r.scalars["diag/data/batches"] for r in recent)
        wait = sum(r.scalars["diag/data/wait_ms"] * r.scalars["diag/data/batches"] for r in recent) / 1e3
        wall = sum(r.scalars.get("diag/data/window_s", 0.0) for r in recent)
        share = min(wait / wall, 1.0) if wall > 0 else 0.0
        if batches < self.min_batches or share <= self.threshold:
            return []
        msg = (f"{100 * share:.0f}% of the wall time is spent waiting for the next batch "
               f"({1e3 * wait / batches:.1f} ms per batch over the last {int(batches)} batches).")
        return [self.make(record.step, msg, share, self.threshold, "data loader", ["persistent"])]

"""The ``data_labels`` probe, fed by the ``batch=`` and ``outputs=`` passed to ``Diagnostics.step``
(``data_finite``, the NaN/Inf and constant-input checks of the batch: :mod:`trackdiag.probes.data_finite`).

``data_labels`` (class targets outside the model's classes) emits:
  ``diag/data/label_first_bad_step`` (-1: none), ``diag/data/label_bad_steps``,
  ``diag/data/label_min`` / ``diag/data/label_max`` (over the window, the ignore value excluded),
  ``diag/data/num_classes`` (from the output's class dimension), ``diag/data/ignore_index`` (the
  padding value in force, when one was seen), and ``diag/data/target_is_input`` (the largest share
  of target positions equal to the input, over the window: 1.0 when the targets are the inputs
  themselves, as in a language model whose targets were not shifted by one). Targets equal to the
  inputs are the convention of models that shift labels inside ``forward`` (Hugging Face's causal
  LMs take ``labels=input_ids``), so while they are, on due steps of the first ``leak_steps`` (300)
  the probe also measures which the loss follows: the table ``diag/data/leak_ce`` holds
  ``copy`` (cross-entropy of the outputs against the targets as they are), ``next`` (against the
  targets shifted one position, along either of the first two dimensions), ``loss``, ``step`` and ``teacher``
  (the share of positions where an integer input of the model's first call holds the previous target token:
  a decoder fed the targets shifted right, whose "copy" of a source equal to its targets is a copy task; seen
  through the models' call slots from the first step whose targets equal its inputs to ``leak_steps``; -1 at
  that first step, whose call was not seen).
  A model learning to copy its input shows ``copy`` far below ``next`` and the loss with it.
  The ignore value: ``ignore_index="auto"`` (default) takes the one negative value the targets use
  for padding (cross-entropy's -100, or -1 as many scripts pass ``ignore_index=-1``) when every
  negative target of a step has that same value, or the one value of at least ``HIGH_IGNORE`` (250)
  every target above the classes has (segmentation's ``255`` "void" pixels), and keeps it; a second
  such value, or other targets outside ``[0, classes)`` (1-based labels: the class count itself),
  are out of range. An int sets it; ``None``: no padding.
  The targets are ``batch[1]`` / ``batch['target']`` ... (option ``target``: index or key); the
  number of classes is the class dimension of the output (option ``output``: index or key of a
  structured output) when the shapes pair up (``(N, C)`` with ``(N,)``, ``(B, T, C)`` with
  ``(B, T)``, ``(N, C, H, W)`` with ``(N, H, W)``); otherwise nothing is checked.
  Cost per step: none for targets (and integer inputs) of at most 4,096 labels, kept by reference and reduced for the
  whole window at the logging step (:func:`label_stats` over the stacked targets of one shape: an ``aminmax``, three masked
  ``max``/``min``, an ``eq``/``mean`` against the input when both are integer tensors of one shape); larger ones get
  those reductions at their step. Copied with everything else and judged on the host.
It collects at every logging step (``always_collect``), so no step of a window is lost.
"""
from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
import torch

from trackdiag.alerts.task import masked_ce
from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.held import Held, Holder
from trackdiag.util.norms import stack_scalars
from trackdiag.util.tensors import HIGH_IGNORE, class_dim, inputs_of, logits_of, targets_of


#: the smallest batch whose holding a single class is counted (``class_sorted_batches``): 8 samples of 2 balanced
#: classes hold one class by chance in 0.8 % of shuffled batches (3 classes: 0.05 %)
ONE_CLASS_MIN_BATCH = 8
#: targets of at most this many labels a step are kept and reduced with the window's at the logging step (a
#: classifier's, a short sequence model's); larger ones at their step (trackdiag.util.held)
HOLD_LABELS = 4096


def label_stats(targets: torch.Tensor, classes: int, inputs: torch.Tensor | None) -> torch.Tensor:
    """Per row of ``targets`` (``(k, n)`` integer class labels, one step's batch a row): ``[lowest, highest, highest
    negative (the dtype's minimum: none), share of positions equal to ``inputs`` (``(k, n)``; -1: no such input),
    lowest at or above ``classes`` (the dtype's maximum: none), highest below it]`` as ``(k, 6)`` float64. One
    reduction each for the whole window; no batch-sized host work."""
    small, big = torch.iinfo(targets.dtype).min, torch.iinfo(targets.dtype).max
    lo, hi = torch.aminmax(targets, dim=1)
    top_neg = torch.where(targets < 0, targets, small).amax(1)  # -inf-like when none
    over = targets >= classes
    low_over = torch.where(over, targets, big).amin(1)  # the smallest target above the classes (+inf-like: none)
    high_in = torch.where(over, small, targets).amax(1)  # the largest target within them
    same = (inputs == targets).float().mean(1) if inputs is not None else torch.full(lo.shape, -1.0, device=lo.device)
    return torch.stack([lo, hi, top_neg, same, low_over, high_in], dim=1).to(torch.float64)


class DataLabelsProbe(Probe):
    """See module docstring (``data_labels``). Args: ``target`` index/key of the targets in the
    batch; ``output`` index/key of the class scores in a structured output; ``ignore_index`` label
    value that is skipped (cross-entropy's default -100; ``None``: none)."""

    name = "data_labels"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, target: int | str | None = None,
                 output: int | str | None = None, ignore_index: int | str | None = "auto", leak_steps: int = 300) -> None:
        super().__init__(enabled=enabled, every=every)
        self.leak_steps = leak_steps
        self._leak: tuple[int, list[torch.Tensor]] | None = None  # (step, [copy, next, loss]) of the window's last due step
        self.target, self.output = target, output
        self.auto = ignore_index == "auto"
        self.ignore_index: int | None = None if self.auto else ignore_index  # type: ignore[assignment]
        # (step, classes, one label per sample, its label_stats row or the (targets, inputs) kept for the logging step)
        self._seen: list[tuple[int, int, bool, torch.Tensor | tuple[Held, Held | None]]] = []
        self._holder = Holder(self.name, HOLD_LABELS)
        self._order: list[int] | None = None  # the collected rows' steps, when not in step order (see _window_rows)
        self._window: tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]] = ((), (), ())  # the collected steps
        self._classes = -1
        self._called: tuple[int, list[torch.Tensor]] | None = None  # (step, integer tensors the model's first call got)
        self._stops: list[Any] = []
        self._watching = False  # the models' first calls were watched from some step on (see _watch_calls)
        self._ctx: ProbeContext | None = None

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx

    def _watch_calls(self) -> None:
        """Once targets equal to the inputs are first measured, up to step ``leak_steps``: each model's first call
        of a step (a decoder fed the targets shifted by one, teacher forcing, makes it a copy task, not a leak).
        One Python call per call of a model while it lasts; loops whose targets are not the inputs' shape never pay it."""
        from trackdiag.capture.forward_watch import FORWARD, may_watch

        ctx = self._ctx
        self._watching = True
        if ctx is not None and may_watch(ctx.compiled):
            for comp in ctx.components:
                if comp.model is not None:
                    root = comp.outer if comp.outer is not None else comp.model
                    self._stops.append(FORWARD.watch(root, post=self._first_call, root=True))

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    def _first_call(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        step = self._ctx.step if self._ctx is not None else -1
        if (self._called is None or self._called[0] != step) and torch.is_grad_enabled():
            ints = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.ndim == 2
                    and not a.is_floating_point() and a.dtype != torch.bool]
            self._called = (step, ints)

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._stops and ctx.step >= self.leak_steps:
            self.detach()
        if inputs.batch is None or inputs.outputs is None:
            return
        self._observe(ctx, inputs)

    def _observe(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        t = targets_of(inputs.batch, self.target)
        logits = logits_of(inputs.outputs, self.output) if t is not None else None
        dim = class_dim(logits, t) if logits is not None and t is not None else None
        if dim is None or t is None or logits is None or t.numel() == 0:
            return
        self._classes = int(logits.shape[dim])
        x = inputs_of(inputs.batch)
        pair = isinstance(x, torch.Tensor) and x.shape == t.shape and not x.is_floating_point() and not x.is_complex()
        # one label per sample (class scores (B, C), targets (B,)): a batch's lo == hi says it holds one class
        per_sample = t.dim() == 1 and logits.dim() == 2 and t.numel() >= ONE_CLASS_MIN_BATCH
        kept = self._holder.hold("targets", t)
        kept_x = self._holder.hold("inputs", x) if kept is not None and pair else None
        if kept is not None and (kept_x is not None or not pair):  # reduced with the window's: no kernel now
            self._seen.append((ctx.step, self._classes, per_sample, (kept, kept_x)))
        else:
            with torch.no_grad():
                row = label_stats(t.reshape(1, -1), self._classes, x.reshape(1, -1) if pair else None)
            self._seen.append((ctx.step, self._classes, per_sample, row))
        if ctx.step < self.leak_steps and dim == -1 and ctx.is_due(self.schedule) and pair and len(inputs.losses) == 1:
            with torch.no_grad():
                self._leak_terms(ctx.step, logits, t, inputs.losses)

    @staticmethod
    def _one_class_batches(classes: Sequence[int], per_sample: Sequence[bool], lo: np.ndarray, hi: np.ndarray,
                           record: Record) -> None:
        """``diag/data/label_batches``: the window's batches of one label per sample, all labels within the classes;
        ``diag/data/one_class_batches``: those holding a single class, counted per class in the table
        ``diag/data/one_class_labels`` (the ``class_sorted_batches`` rule)."""
        batches, per_class = 0, collections.Counter()
        for n, ok, a, b in zip(classes, per_sample, lo.tolist(), hi.tolist()):
            if ok and 0 <= a and b < n:
                batches += 1
                if a == b:
                    per_class[str(int(a))] += 1
        if batches:
            record.scalars["diag/data/label_batches"] = float(batches)
            record.scalars["diag/data/one_class_batches"] = float(sum(per_class.values()))
            if per_class:
                record.tables["diag/data/one_class_labels"] = {k: float(v) for k, v in per_class.items()}

    def _leak_terms(self, step: int, logits: torch.Tensor, t: torch.Tensor, losses: Any) -> None:
        """Cross-entropy of the outputs against the targets as they are and shifted one position (device)."""
        loss = next(iter(losses.values()))
        if not isinstance(loss, torch.Tensor):
            return
        scores = logits.detach().float()
        copy = masked_ce(scores, t)[0]
        nexts = [masked_ce(scores[:, :-1], t[:, 1:])[0]] if t.dim() >= 2 and t.shape[1] > 1 else []
        if t.dim() >= 2 and t.shape[0] > 1:
            nexts.append(masked_ce(scores[:-1], t[1:])[0])
        if not self._watching:  # this step's call was not seen: the rule waits for the next measurement
            self._watch_calls()
            teacher = copy.new_full((), -1.0)
        else:
            teacher = self._teacher(step, t)
        if nexts:
            self._leak = (step, [copy, torch.stack(nexts).min(), loss.detach().float().reshape(()), teacher])

    def _teacher(self, step: int, t: torch.Tensor) -> torch.Tensor:
        """The largest share of positions where an integer input of the model's first call this step holds the
        previous target token (``a[:, 1:] == t[:, :-1]``: a decoder fed the targets shifted right); 0 when none
        (a compiled model's calls are not watched: 0)."""
        best = t.new_zeros((), dtype=torch.float32)
        if self._called is None or self._called[0] != step or t.dim() != 2 or t.shape[1] < 2:
            return best
        for a in self._called[1]:
            if a.shape == t.shape and a.device == t.device:
                best = torch.maximum(best, (a[:, 1:] == t[:, :-1]).float().mean())
        return best

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        """The window's per-step label statistics, a few kernels for the window (:meth:`_window_rows`), copied with
        everything else; judged on the host (no tensor is built from host values: that copy would sync on CUDA)."""
        seen, self._seen = self._intact(self._seen), []
        self._holder.window_done()
        out: dict[str, torch.Tensor | float] = {}
        if seen:
            steps, classes, per_sample, stats = zip(*seen)
            self._window = (steps, classes, per_sample)
            out["stats"], self._order = self._window_rows(stats, classes)
        else:
            self._window, self._order = ((), (), ()), None
        if self._leak is not None:
            out["leak"] = stack_scalars(self._leak[1], torch.float64)
            self._leak_step, self._leak = self._leak[0], None
        return out

    def _intact(self, seen: list[Any]) -> list[Any]:
        """``seen`` without the steps whose kept targets (or inputs) were written into since (a reused buffer)."""
        lost = {"targets": 0, "inputs": 0}
        keep = []
        for entry in seen:
            kept = entry[3]
            if type(kept) is tuple:
                if not kept[0].intact:
                    lost["targets"] += 1
                    continue
                if kept[1] is not None and not kept[1].intact:
                    lost["inputs"] += 1
                    continue
            keep.append(entry)
        for what, n in lost.items():
            if n:
                self._holder.overwritten(what, n)
        return keep

    @staticmethod
    def _window_rows(stats: Sequence[Any], classes: Sequence[int]) -> tuple[torch.Tensor, list[int] | None]:
        """``(N, 6)`` float64 :func:`label_stats` rows of the window and, when they are not in step order, the step
        index of each row. Kept targets of one shape, dtype and class count (a fixed batch size: the whole window)
        are stacked and reduced together; rows reduced at their step are stacked as they are."""
        groups: dict[Any, list[int]] = {}
        for i, (s, n) in enumerate(zip(stats, classes)):
            if type(s) is tuple:
                t, x = s[0].tensor, s[1].tensor if s[1] is not None else None
                key: Any = (t.dtype, t.device, t.numel(), n, None if x is None else x.dtype)
            else:
                key = "now"
            groups.setdefault(key, []).append(i)
        chunks: list[torch.Tensor] = []
        order: list[int] = []
        with torch.no_grad():
            for key, idx in groups.items():
                if key == "now":
                    chunks.append(torch.cat([stats[i] for i in idx]))
                else:
                    targets = torch.stack([stats[i][0].tensor.reshape(-1) for i in idx])
                    inputs = torch.stack([stats[i][1].tensor.reshape(-1) for i in idx]) if key[4] is not None else None
                    chunks.append(label_stats(targets, key[3], inputs))
                order += idx
            rows = chunks[0] if len(chunks) == 1 else torch.cat([c.to(chunks[0].device) for c in chunks])
        return rows, (order if order != list(range(len(order))) else None)

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        if self._window[0]:
            self._judge(values["stats"], record)
        leak = values.get("leak")
        if leak is not None:
            copy, nxt, loss, teacher = (float(v) for v in leak.reshape(-1))
            record.tables["diag/data/leak_ce"] = {"copy": copy, "next": nxt, "loss": loss, "step": float(self._leak_step),
                                                  "teacher": teacher}

    def _judge(self, stats: np.ndarray, record: Record) -> None:
        """The window's label rows (:func:`label_stats`) judged: out-of-range steps, the padding value, the ranges."""
        steps, classes, per_sample = self._window
        rows = stats.reshape(len(steps), 6)
        if self._order is not None:  # rows grouped by shape: back in step order
            ordered = np.empty_like(rows)
            ordered[np.asarray(self._order)] = rows
            rows = ordered
        lo, hi, top_neg, same, low_over, high_in = rows.T
        self._one_class_batches(classes, per_sample, lo, hi, record)
        bad = np.zeros(len(steps), dtype=bool)
        lows, highs = [], []
        for i, (a, b) in enumerate(zip(lo.tolist(), top_neg.tolist())):
            if a >= 0:
                lows.append(a)
                continue
            single = a == b  # every negative target of this step has one value: padding
            if single and self.ignore_index is None and self.auto:
                self.ignore_index = int(a)  # learnt once: cross-entropy's -100, or the -1 a script passes
            if not (single and a == self.ignore_index):
                bad[i] = True
                lows.append(a)
        for i, (a, b, c, n) in enumerate(zip(hi.tolist(), low_over.tolist(), high_in.tolist(), classes)):
            if a < n:
                highs.append(a)
                continue
            single = a == b  # every target above the classes has one value: segmentation's void label
            if single and a >= HIGH_IGNORE and self.ignore_index is None and self.auto:
                self.ignore_index = int(a)
            if single and a == self.ignore_index:
                if c >= 0:  # a step whose targets are all void has no largest class
                    highs.append(c)
            else:
                bad[i] = True
                highs.append(a)
        record.scalars["diag/data/label_first_bad_step"] = float(steps[int(np.argmax(bad))]) if bad.any() else -1.0
        record.scalars["diag/data/label_bad_steps"] = float(bad.sum())
        record.scalars["diag/data/label_min"] = float(min(lows)) if lows else 0.0
        record.scalars["diag/data/label_max"] = float(max(highs)) if highs else 0.0
        record.scalars["diag/data/num_classes"] = float(self._classes)
        if self.ignore_index is not None:
            record.scalars["diag/data/ignore_index"] = float(self.ignore_index)
        if (same >= 0).any():
            i = int(np.argmax(same))
            record.scalars["diag/data/target_is_input"] = float(same[i])
            record.tables["diag/data/target_is_input"] = {"step": float(steps[i])}

"""``rnn_layout``: a recurrent layer fed its batch along the axis it takes as time (``rnn_batch_first``).

``nn.LSTM``/``nn.GRU``/``nn.RNN`` take ``(time, batch, features)`` unless built with ``batch_first=True``. A loop whose
data is ``(batch, time, features)`` and a layer left at the default (or the reverse) runs the recurrence across the
samples of the batch: each output mixes the samples before it, ``out[:, -1]`` picks a position of every sequence, and
the model still learns something. Nothing crashes when the shapes line up (a classifier reading ``out[:, -1]``).

For the first ``steps`` (20) steps the probe watches each recurrent layer's first call of a step (a forward pre-hook
while watching, then none) and reads the shape of its input (a 3-D tensor; a ``PackedSequence`` is not judged). At
``step()`` it compares it with the step's batch size, taken where it is unambiguous: the leading dimension of 2-D
outputs (one row of scores per sample: ``(N, C)``) or the length of 1-D targets. When exactly one of the input's first
two dimensions equals the batch size and it is the one the layer takes as time, the step counts against the layer;
when it is the one the layer takes as the batch, for it. Emitted, per component, once ``checks`` (3) steps were judged
or the watch ended: the table ``diag/[<c>/]model/rnn_batch_axis`` (``{layer: 1.0 when every judged step put the batch
on the time axis, else 0.0, <layer>/batch_first, <layer>/dim0, <layer>/dim1, <layer>/batch}``). Cost: the global
forward pre-hook for at most 20 steps (~2 us per module call), a shape read per judged step; nothing after. Compiled
models are not watched (the hook's removal would cost a recompile).
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.capture.forward_watch import FORWARD
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never
from trackdiag.util.tensors import logits_of, targets_of


class RnnLayoutProbe(Probe):
    """See module docstring. Args: ``steps`` how long to watch, ``checks`` how many judged steps suffice."""

    name = "rnn_layout"
    always_collect = True
    #: the layers watched (each has ``batch_first``) and the table their verdicts go to
    layer_types: tuple[type[nn.Module], ...] = (nn.RNNBase,)
    table = "model/rnn_batch_axis"

    def __init__(self, *, enabled: bool = True, every: int | None = None, steps: int = 20, checks: int = 3) -> None:
        super().__init__(enabled=enabled, every=every)
        self.steps, self.checks = steps, checks
        self._stops: list[Any] = []
        self._layers: list[tuple[Any, str, nn.Module]] = []  # (component, name, layer)
        self._seen: dict[int, tuple[int, int]] = {}  # id(layer) -> its input's first two dims, this step
        self._votes: dict[int, list[bool]] = {}  # id(layer) -> per judged step: the batch on the time axis
        self._shape: dict[int, tuple[int, int, int]] = {}  # id(layer) -> (dim0, dim1, batch) last judged
        self._done = False
        self._emit = False

    def bind(self, default_every: int) -> None:
        self.schedule = Never()

    def quiet(self, ctx: ProbeContext) -> bool:
        return self._done and not self._emit

    def attach(self, ctx: ProbeContext) -> None:
        if ctx.compiled:  # the global pre-hook's removal after the watch would cost a compiled model a recompile
            self._done = True
            return
        for comp in ctx.components:
            if comp.model is None:
                continue
            for name, m in comp.model.named_modules():
                if isinstance(m, self.layer_types):
                    self._layers.append((comp, name, m))
                    self._stops.append(FORWARD.watch(m, pre=partial(self._saw, id(m))))
        self._done = not self._layers

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    def _saw(self, key: int, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if key not in self._seen and isinstance(x, torch.Tensor) and x.dim() == 3:
            self._seen[key] = (int(x.shape[0]), int(x.shape[1]))

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._done:
            return
        seen, self._seen = self._seen, {}
        batch = _batch_size(inputs)
        if batch is not None:
            for _, _, layer in self._layers:
                dims = seen.get(id(layer))
                if dims is None or (dims[0] == batch) == (dims[1] == batch):
                    continue  # not called, or the batch size on neither axis or both: nothing to say
                on_time = dims[1 if layer.batch_first else 0] == batch
                self._votes.setdefault(id(layer), []).append(on_time)
                self._shape[id(layer)] = (*dims, batch)
        judged = min((len(self._votes.get(id(m), ())) for _, _, m in self._layers), default=0)
        if judged >= self.checks or ctx.step + 1 >= self.steps:
            self.detach()
            self._done, self._emit = True, bool(self._votes)

    def collect(self, ctx: ProbeContext) -> dict[str, torch.Tensor | float]:
        return {"judged": float(len(self._votes))} if self._emit else {}  # publish() is called for what was collected

    def publish(self, ctx: ProbeContext, values: dict[str, Any], record: Record) -> None:
        if not self._emit:
            return
        self._emit = False
        for comp, name, layer in self._layers:
            votes = self._votes.get(id(layer))
            if not votes:
                continue
            d0, d1, batch = self._shape[id(layer)]
            table = record.tables.setdefault(comp.key(self.table), {})
            table[name] = 1.0 if len(votes) >= 2 and all(votes) else 0.0
            table.update({f"{name}/batch_first": float(layer.batch_first), f"{name}/dim0": float(d0),
                          f"{name}/dim1": float(d1), f"{name}/batch": float(batch)})


def _batch_size(inputs: StepInputs) -> int | None:
    """The step's batch size where it is unambiguous: 2-D outputs' rows (one per sample), else 1-D targets' length."""
    if inputs.outputs is not None:
        z = logits_of(inputs.outputs)
        if z is not None and z.dim() == 2:
            return int(z.shape[0])
    if inputs.batch is not None:
        t = targets_of(inputs.batch, None)
        if isinstance(t, torch.Tensor) and t.dim() == 1:
            return int(t.shape[0])
    return None

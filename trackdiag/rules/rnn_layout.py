"""A layer fed its batch along the axis it reads as time or sequence: ``rnn_batch_first`` (a recurrent layer, the
``rnn_layout`` probe) and ``attention_batch_first`` (``nn.MultiheadAttention``, the ``attention_layout`` probe)."""
from __future__ import annotations

from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer


class RnnBatchFirst(OncePer):
    """Fires when the table ``diag/[<c>/]model/rnn_batch_axis`` marks a layer (1.0): at every judged step (at least
    two) its input had the step's batch size on the axis the layer takes as time (``batch_first=False`` and a
    ``(batch, time, features)`` input, or the reverse). The recurrence runs across the samples of the batch: each output
    mixes the samples before it, and a "last time step" is a position of every sequence. ``step``: the record's;
    ``persistent`` (a warning), once per layer."""

    kind = "rnn_batch_first"
    hint = ("Build the layer with batch_first=True for (batch, time, features) inputs (nn.LSTM(..., batch_first=True)), "
            "or feed it x.transpose(0, 1); its hidden state h_n is (layers, batch, hidden) either way.")
    table = "model/rnn_batch_axis"
    layer, axis, shapes = "recurrent layer", "time", ("(batch, time, features)", "(time, batch, features)")
    effect = ("the recurrence runs across the samples of each batch, every output mixes the samples before it, and a "
              "\"last time step\" is a position of every sequence.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, table in record.tables.items():
            if not key.endswith(self.table):
                continue
            for layer, bad in table.items():
                if "/" in layer or bad != 1.0 or not self.first(f"{key}:{layer}"):
                    continue
                first = bool(table.get(f"{layer}/batch_first", 0.0))
                d0, d1, batch = (int(table.get(f"{layer}/{k}", 0)) for k in ("dim0", "dim1", "batch"))
                takes = self.shapes[0] if first else self.shapes[1]
                msg = (f"{self.layer} {layer} (batch_first={first}) takes {takes} inputs, but its input ({d0}, {d1}, "
                       f"...) has the batch size {batch} on the axis it reads as {self.axis}: {self.effect}")
                out.append(self.make(record.step, msg, float(batch), float(d1 if first else d0), layer, ["persistent"]))
        return out


class AttentionBatchFirst(RnnBatchFirst):
    """Fires when the table ``diag/[<c>/]model/attention_batch_axis`` marks an ``nn.MultiheadAttention`` (1.0): at
    every judged step (at least two) its query had the step's batch size on the axis the layer takes as the sequence
    (``batch_first=False``, the default of ``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer``, with
    ``(batch, sequence, embedding)`` data, or the reverse). Every position attends across the samples of the batch.
    ``step``: the record's; ``persistent`` (a warning), once per layer."""

    kind = "attention_batch_first"
    hint = ("Build the attention layer with batch_first=True for (batch, sequence, embedding) inputs "
            "(nn.MultiheadAttention(..., batch_first=True), nn.TransformerEncoderLayer(..., batch_first=True)), or "
            "feed it x.transpose(0, 1).")
    table = "model/attention_batch_axis"
    layer, axis = "attention layer", "the sequence"
    shapes = ("(batch, sequence, embedding)", "(sequence, batch, embedding)")
    effect = ("every position attends across the samples of the batch instead of along its own sequence, and a "
              "pooled or first-token read-out mixes the samples.")

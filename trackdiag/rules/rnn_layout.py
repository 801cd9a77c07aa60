"""``rnn_batch_first``: a recurrent layer fed its batch along the axis it takes as time (the ``rnn_layout`` probe)."""
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

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, table in record.tables.items():
            if not key.endswith("model/rnn_batch_axis"):
                continue
            for layer, bad in table.items():
                if "/" in layer or bad != 1.0 or not self.first(f"{key}:{layer}"):
                    continue
                first = bool(table.get(f"{layer}/batch_first", 0.0))
                d0, d1, batch = (int(table.get(f"{layer}/{k}", 0)) for k in ("dim0", "dim1", "batch"))
                takes = "(batch, time, features)" if first else "(time, batch, features)"
                msg = (f"recurrent layer {layer} (batch_first={first}) takes {takes} inputs, but its input "
                       f"({d0}, {d1}, ...) has the batch size {batch} on the axis it reads as time: the recurrence runs "
                       f"across the samples of each batch, every output mixes the samples before it, and a \"last time "
                       f"step\" is a position of every sequence.")
                out.append(self.make(record.step, msg, float(batch), float(d1 if first else d0), layer, ["persistent"]))
        return out

"""``attention_layout``: an attention layer fed its batch along the axis it takes as the sequence
(``attention_batch_first``).

``nn.MultiheadAttention`` (and so ``nn.TransformerEncoderLayer``, ``nn.TransformerDecoderLayer`` and ``nn.Transformer``,
which call it) takes ``(sequence, batch, embedding)`` unless built with ``batch_first=True``. A loop whose data is
``(batch, sequence, embedding)`` and a layer left at the default makes every position attend across the samples of the
batch instead of along its own sequence; a mean or first-token read-out of the output still trains, and nothing crashes.

The same watch as ``rnn_layout`` (see there), on each ``nn.MultiheadAttention`` module's query: for the first ``steps``
(20) steps, the first call of a step, its input's first two dimensions against the step's batch size where that is
unambiguous. Emitted, per component, once ``checks`` (3) steps were judged or the watch ended: the table
``diag/[<c>/]model/attention_batch_axis`` (the same fields as ``rnn_batch_axis``). A layer called with keyword
arguments only, or on the fused inference path (eval mode, no autograd), is not judged. Cost: as ``rnn_layout``.
"""
from __future__ import annotations

from torch import nn

from trackdiag.probes.rnn_layout import RnnLayoutProbe


class AttentionLayoutProbe(RnnLayoutProbe):
    """See module docstring. Args: ``steps`` how long to watch, ``checks`` how many judged steps suffice."""

    name = "attention_layout"
    layer_types = (nn.MultiheadAttention,)
    table = "model/attention_batch_axis"

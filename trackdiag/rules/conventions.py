"""``tf_convention``: a layer argument in TensorFlow's convention, which PyTorch reads as its complement (the
``conventions`` probe)."""
from __future__ import annotations

from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer

_SAYS = {
    "dropout_p": ("nn.Dropout(p={v:g}) zeroes {v:.0%} of its inputs at every training step (PyTorch's p is the "
                  "probability of dropping a unit; TensorFlow's keep_prob={v:g} would keep them)"),
    "bn_momentum": ("batch norm momentum={v:g} gives the newest batch a weight of {v:g} in the running statistics "
                    "(PyTorch's momentum is Keras' 1 - momentum, TensorFlow's 1 - decay; the default is 0.1): every "
                    "evaluation normalises with little more than the last training batch's mean and variance"),
}


class TfConvention(OncePer):
    """Fires when the tables ``diag/[<c>/]model/dropout_p`` or ``diag/[<c>/]model/bn_momentum`` list a layer: a
    dropout probability of 0.8 or more, a batch-norm momentum of 0.5 or more, the values TensorFlow code writes for the
    opposite meaning (``keep_prob``, Keras' ``momentum``/TF's ``decay``). ``step``: the record's (the first logging
    step); ``persistent`` (a warning: the layer is built that way for the whole run), once per layer."""

    kind = "tf_convention"
    hint = ("nn.Dropout(p) drops with probability p: TensorFlow's keep_prob=k is nn.Dropout(1 - k). nn.BatchNorm's "
            "momentum is the weight of the new batch (default 0.1): Keras' momentum=m (TF's decay=m) is "
            "nn.BatchNorm2d(..., momentum=1 - m). If the value is deliberate, set "
            "diag.rules.tf_convention.action=ignore.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, table in record.tables.items():
            what = next((w for w in _SAYS if key.endswith(f"model/{w}")), None)
            if what is None:
                continue
            for layer, value in table.items():
                if self.first(f"{key}:{layer}"):
                    msg = f"layer {layer}: {_SAYS[what].format(v=value)}."
                    out.append(self.make(record.step, msg, float(value), where=layer, evidence=["persistent"]))
        return out

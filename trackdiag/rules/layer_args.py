"""Layer arguments that do not mean what they were written for (the ``layer_args`` probe): ``tf_convention`` (a
dropout probability or batch-norm momentum in TensorFlow's convention) and ``linear_activation`` (``nn.LeakyReLU(True)``)."""
from __future__ import annotations

from typing import Iterator, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import OncePer


def _listed(record: Record, whats: Sequence[str]) -> Iterator[tuple[str, str, str, float]]:
    """``(table key, what, layer, value)`` for every layer the probe's tables named ``model/<what>`` list."""
    for key, table in record.tables.items():
        what = next((w for w in whats if key.endswith(f"model/{w}")), None)
        if what is not None:
            for layer, value in table.items():
                yield key, what, layer, value


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
    _says = {
        "dropout_p": ("nn.Dropout(p={v:g}) zeroes {v:.0%} of its inputs at every training step (PyTorch's p is the "
                      "probability of dropping a unit; TensorFlow's keep_prob={v:g} would keep them)"),
        "bn_momentum": ("batch norm momentum={v:g} gives the newest batch a weight of {v:g} in the running statistics "
                        "(PyTorch's momentum is Keras' 1 - momentum, TensorFlow's 1 - decay; the default is 0.1): every "
                        "evaluation normalises with little more than the last training batch's mean and variance"),
    }

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return [self.make(record.step, f"layer {layer}: {self._says[what].format(v=value)}.", float(value),
                          where=layer, evidence=["persistent"])
                for key, what, layer, value in _listed(record, list(self._says)) if self.first(f"{key}:{layer}")]


class LinearActivation(OncePer):
    """Fires when the table ``diag/[<c>/]model/leaky_slope`` lists a layer: an ``nn.LeakyReLU`` whose
    ``negative_slope`` is 1 (``nn.LeakyReLU(True)``, written as ``nn.ReLU(True)`` is for ``inplace``): the activation
    is the identity, and the layers around it compose into one linear map. ``step``: the record's; ``persistent`` (a warning), once per layer."""

    kind = "linear_activation"
    hint = ("nn.LeakyReLU's first argument is negative_slope: write nn.LeakyReLU(0.2, inplace=True) (or "
            "nn.LeakyReLU(inplace=True) for the default slope 0.01); nn.ReLU(True) is the one whose first argument is "
            "inplace.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, _, layer, value in _listed(record, ["leaky_slope"]):
            if self.first(f"{key}:{layer}"):
                msg = (f"layer {layer}: nn.LeakyReLU with negative_slope=1 (nn.LeakyReLU(True) passes True as the "
                       f"slope) is the identity: the layers around it compose into one linear map.")
                out.append(self.make(record.step, msg, float(value), where=layer, evidence=["persistent"]))
        return out

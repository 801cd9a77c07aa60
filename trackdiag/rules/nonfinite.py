"""NaN/Inf rules: ``nonfinite_loss``, ``nonfinite_grad``, ``nonfinite_param``."""
from __future__ import annotations

import math
from typing import Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule, loss_series, loss_where, where_of
from trackdiag.util.modnames import layer_label


class NonfiniteLoss(Rule):
    """Fires at the first step whose loss is NaN or Inf (exact step: the loss is kept every step)."""

    kind = "nonfinite_loss"
    hint = ("Find where it starts (the NaN replay names the module when diag.probes.nan_replay is on). Usual causes: "
            "NaN/Inf in the batch (fix the data); log/div/sqrt without an eps (log(x + 1e-8)); weights blown up by a "
            "learning rate too high (lower it, clip gradients with clip_grad_norm_); fp16 overflow (GradScaler or bf16).")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        ranks = record.tables.get("diag/dist/nonfinite_rank", {})  # under torch.distributed: who went first
        for key, points in loss_series(record).items():
            for step, v in points:
                if not math.isfinite(v):
                    where, msg = loss_where(key), f"the loss is {v} at step {step}."
                    if key in ranks:
                        rank = f"rank {int(ranks[key])}"
                        comp = where_of(key)
                        where, msg = f"{comp}, {rank}" if comp else rank, f"the loss is {v} at step {step} (first on {rank})."
                    out.append(self.make(step, msg, v, math.nan, where, ["unambiguous"]))
                    break
        return out


class _NonfiniteTensors(Rule):
    family = ""  # "grad" or "param"

    def incident_key(self, alert: Alert) -> str:
        """One incident while it lasts, wherever it is seen: its first layer on the steps that check the
        tensors, the component from the every-step norm in between (two ``where``s, one NaN)."""
        return ""

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            n = record.scalars.get(comp.key(f"{self.family}/nonfinite_tensors"), 0.0)
            if n > 0:
                layers = record.tables.get(comp.key(f"{self.family}/nonfinite_layers"), {})
                first = next(iter(layers), "")
                where = layer_label(comp, first) if first else comp.name
                what = "gradient" if self.family == "grad" else "parameter"
                out.append(self.make(record.step, f"{int(n)} {what} tensor(s) hold NaN/Inf; first in {where or 'the model'}.", n, 0, where, ["unambiguous"]))
        return out


class NonfiniteGrad(_NonfiniteTensors):
    """Fires when any gradient tensor holds NaN/Inf at the optimizer step (``where`` is the first layer,
    on the steps gradient tensors are checked), or at the exact step the every-step pre-clip global
    norm is NaN/Inf (``where`` the component): a gradient that overflowed between two logging steps."""

    kind = "nonfinite_grad"
    family = "grad"
    hint = ("Find the op that produces it (trackdiag's NaN replay or torch.autograd.set_detect_anomaly), guard "
            "log/sqrt/div with an eps, clip gradients, lower the learning rate.")

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            bad = next(((s, v) for s, v in record.series.get(comp.key("grad/global_norm"), []) if not math.isfinite(v)), None)
            tensors = super().check(record, history, [comp])  # on the steps gradient tensors are checked
            if tensors:
                a = tensors[0]
                if bad is not None and bad[0] < a.step:  # the every-step norm saw it first: that is the step
                    a = self.make(bad[0], f"{a.message[:-1]}; the pre-clip global norm went {bad[1]} at step {bad[0]}.",
                                  a.value, a.threshold, a.where, ["unambiguous"])
                out.append(a)
            elif bad is not None:
                msg = f"the pre-clip global gradient norm is {bad[1]} at step {bad[0]}: a gradient overflowed or went NaN."
                out.append(self.make(bad[0], msg, bad[1], math.nan, comp.name, ["unambiguous"]))
        return out


class NonfiniteParam(_NonfiniteTensors):
    """Fires when any parameter holds NaN/Inf after the optimizer step; ``where`` is the first layer."""

    kind = "nonfinite_param"
    family = "param"
    hint = ("The optimizer wrote NaN/Inf into the weights: restore the last good checkpoint, lower the "
            "learning rate, clip gradients, check the optimizer's eps.")

"""``plateau``: the evaluation loss or a smoothed train loss that stopped improving (moved here from
``generalization``, unchanged)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule, where_of


class Plateau(Rule):
    """Fires when a loss stops improving:

    - evaluation: ``diag/eval/<metric>`` has not improved on its best by more than ``min_delta``
      (1e-4) for ``patience`` (10) evaluations (the guides' early-stopping rule);
    - training: the smoothed train loss (``loss/ema``) has not improved on its best by more than
      ``max(min_delta, rel_delta x |best|)`` (``rel_delta`` 0.01) for ``patience_steps`` (1000) steps.

    Fires once per plateau. ``where``: ``eval/<metric>``, or the loss (``loss`` / ``<component>``).
    A converged run plateaus too: the severity is ``info``.
    """

    kind = "plateau"
    hint = ("If not converged: raise or lower the LR (check diag/update/ratio_median, ~1e-3 is healthy), use an LR "
            "schedule (ReduceLROnPlateau, warm restarts), look for dead units, vanishing gradients or a frozen "
            "layer; if converged: stop early and keep the best checkpoint.")

    def __init__(self, *, patience: int = 10, min_delta: float = 1e-4, patience_steps: int = 1000,
                 rel_delta: float = 0.01, metric: str = "loss", **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_delta, self.metric = max(1, patience), min_delta, metric
        self.patience_steps, self.rel_delta = max(1, patience_steps), rel_delta
        self._eval = {"best": math.inf, "since": 0, "step": -1}
        self._train: dict[str, dict[str, float]] = {}

    def check_eval(self, record: Record, history: Sequence[Record]) -> list[Alert]:
        val = record.scalars.get(f"diag/eval/{self.metric}")
        if val is None or not math.isfinite(val):
            return []
        st = self._eval
        if val < st["best"] - self.min_delta:
            st.update(best=val, since=0, step=record.step)
            return []
        st["since"] += 1
        if st["since"] != self.patience:
            return []
        msg = (f"validation {self.metric} has not improved by more than {self.min_delta:g} for {self.patience} "
               f"evaluations (best {st['best']:.4g} at step {int(st['step'])}, now {val:.4g}).")
        return [self.make(record.step, msg, val, st["best"] - self.min_delta, f"eval/{self.metric}")]

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for key, v in record.scalars.items():
            if not key.endswith("loss/ema") or not math.isfinite(v) or not self.minimised(where_of(key[: -len("/ema")])):
                continue  # an RL or GAN loss is not expected to fall (docs/alert-policy.md)
            st = self._train.setdefault(key, {"best": math.inf, "step": record.step, "fired": 0.0})
            if v < st["best"] - max(self.min_delta, self.rel_delta * abs(st["best"])) or not math.isfinite(st["best"]):
                st.update(best=v, step=record.step, fired=0.0)
            elif record.step - st["step"] >= self.patience_steps and not st["fired"]:
                st["fired"] = 1.0
                where = where_of(key[: -len("/ema")]) or "loss"
                msg = (f"train loss (EMA {v:.4g}) has not improved by {self.rel_delta:.0%} on its best {st['best']:.4g} "
                       f"(step {int(st['step'])}) for {record.step - int(st['step'])} steps.")
                out.append(self.make(record.step, msg, v, st["best"], where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"eval": dict(self._eval), "train": {k: dict(s) for k, s in self._train.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._eval.update(state.get("eval", {}))
        self._train = {k: dict(s) for k, s in state.get("train", {}).items()}

"""``weights_moved``: a component's weights changed between two steps of its optimizers, by something that is not
a watched optimizer (a reversed EMA update written into the trained model, a checkpoint reloaded every epoch)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule
from trackdiag.util.modnames import layer_label


class WeightsMoved(Rule):
    """Reads the ``moved`` probe's ``diag/[<c>/]moved/ratio``: how far the weights moved between the optimizer's last
    step and its next one (tensors whose move is not a pure shrink), relative to what the optimizer's own step did
    to the same fingerprints. A healthy loop leaves the weights alone between steps: 0, bit for bit; clipping,
    max-norm projections and pruning only shrink and are not counted; a perturb-and-restore (SAM) leaves rounding
    noise (~1e-4). A reversed EMA (``p.copy_(decay * ema_p + (1 - decay) * p)`` into the trained model) undoes about
    the whole step every step: 0.1-1 in the corpus (0.07-0.1 where most of its moves look like shrinks, as an
    embedding whose magnitudes the optimizer grows). Raised (``persistent``: a warning) when the ratio is above
    ``ratio`` (0.05) at ``patience`` (2) consecutive measurements (a checkpoint restored once, a one-off edit, stays
    silent); ``step`` is the first of them (the weights moved between that step's optimizer step and the one
    before), ``where`` the component and the layers that moved most. A component whose optimizer is behind a wrapper
    that may move the weights itself (Lookahead), tensors in shared memory (Hogwild) and tensors another component's
    optimizer steps are not measured (see :mod:`trackdiag.probes.moved`)."""

    kind = "weights_moved"
    hint = ("Something other than the optimizer changes the trained weights between optimizer steps, and undoes "
            "its work: an EMA update written into the model instead of the EMA copy (ema_p.lerp_(p, 1 - decay), "
            "not p.copy_(decay * ema_p + (1 - decay) * p)), a checkpoint or 'best' state reloaded every epoch, "
            "load_state_dict / copy_ into the trained model, two models that share tensors. Update only the EMA "
            "copy, reload once before training, and give every optimizer that steps these weights to trackdiag. "
            "Set on purpose (federated averaging or Reptile loading averaged weights into this model between local "
            "steps): diag.rules.weights_moved.enabled=false.")

    def __init__(self, *, ratio: float = 0.05, patience: int = 2, **kw: Any) -> None:
        super().__init__(**kw)
        self.ratio, self.patience = ratio, max(1, patience)
        self._streak: dict[str, list[tuple[int, float, dict[str, float]]]] = {}  # component -> flagged measurements
        self._told: set[str] = set()

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            value = record.scalars.get(comp.key("moved/ratio"))
            if value is None or math.isnan(value):
                continue  # not measured at this record: the streak waits
            if value <= self.ratio:
                self._streak.pop(comp.name, None)
                continue
            streak = self._streak.setdefault(comp.name, [])
            streak.append((record.step, value, dict(record.tables.get(comp.key("moved/layers"), {}))))
            if len(streak) >= self.patience and comp.name not in self._told:
                self._told.add(comp.name)
                out.append(self._alert(comp, streak))
        return out

    def _alert(self, comp: Component, streak: list[tuple[int, float, dict[str, float]]]) -> Alert:
        step, _, _ = streak[0]
        layers: dict[str, float] = {}
        for _, _, table in streak:
            for k, v in table.items():
                layers[k] = max(layers.get(k, 0.0), v)
        top = sorted(layers, key=lambda k: -layers[k])[:3]
        named = [layer_label(comp, k) for k in top]
        ratios = ", ".join(f"{v:.2g}" for _, v, _ in streak)
        where = f"{comp.name}: {', '.join(named)}" if comp.name and named else (", ".join(named) or comp.name or "model")
        msg = (f"the weights{' of ' + comp.name if comp.name else ''} changed between optimizer steps, with no step of "
               f"a watched optimizer: from after step {step - 1}'s update to before step {step}'s, they moved "
               f"{ratios} x as far as the optimizer's own step (measured at steps "
               f"{', '.join(str(s) for s, _, _ in streak)}; 0 in a loop that leaves them alone)"
               + (f"; most in {', '.join(named)}" if named else "") + ". Something writes into the trained weights "
               "and undoes the optimizer's work: training stalls without an error.")
        return self.make(step, msg, streak[-1][1], self.ratio, where, ["persistent"])

    def state_dict(self) -> dict[str, Any]:
        return {"told": sorted(self._told)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._told = set(state.get("told", []))

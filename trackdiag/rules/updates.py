"""Parameter-update rules: ``update_ratio`` (steps far from ~1e-3 of the weights) and
``stale_params`` (layers that never get a gradient or never change)."""
from __future__ import annotations

import math
from typing import Any, Sequence

from trackdiag.alert import Alert
from trackdiag.context import Component
from trackdiag.record import Record
from trackdiag.modnames import layer_label, layers_named
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import Rule, layer_values


def qualified(comp: Component, layer: str) -> str:
    """``<component>.<layer>`` for a named component, else the layer; a bare index with its module
    type (``0 (Linear)``)."""
    return layer_label(comp, layer)


class UpdateRatio(Rule):
    """Fires when a layer's update-to-weight ratio ||dw||/||w|| (``diag/update/ratio/<layer>``) stays
    above ``high`` (1.0: each step moves the weights by more than their own size: a learning rate
    orders of magnitude too high, a weight decay that flips the weights) or inside (0, ``low``)
    (1e-6: the layer is not learning) for ``patience`` (3) consecutive measurements. Healthy runs of
    real scripts sit at 0.1-0.5 for long stretches (small-init Adam in its first steps,
    word_language_model's SGD at lr 20 with clipping at 0.25 throughout): the guides' ~1e-3 is a
    diagnosis, not an alarm. A ratio of
    exactly 0 is left to ``stale_params``. "Too small" is not judged while the learning rate
    (``diag/opt/lr``, when the ``lr`` probe runs) is below ``lr_fraction`` (1%) of the largest seen so
    far: the end of a cosine schedule anneals on purpose. One alert per direction and check, naming the
    worst layer in ``where`` and the number of layers concerned in the message; ``step`` is where it began.
    A single measurement above ``extreme`` (10: the weights moved ten times their size in one step)
    fires at once."""

    kind = "update_ratio"
    severity = "warning"
    hint = ("A healthy update is ~1e-3 of the weights. Too large: lower the learning rate, add warm-up, clip "
            "gradients, check weight decay and the init scale. Too small: raise the learning rate (or check the "
            "schedule/param group), look for vanishing gradients or an over-large weight init.")

    def __init__(self, *, high: float = 1.0, extreme: float = 10.0, low: float = 1e-6, patience: int = 3,
                 lr_fraction: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.high, self.low, self.patience, self.lr_fraction = high, low, patience, lr_fraction
        self.extreme = extreme
        self._streaks = Streaks(patience)
        self._max_lr: dict[str, float] = {}

    def _limit(self, step: int) -> float:
        return self.high

    def _off(self, direction: str, v: float, annealed: bool, step: int) -> bool:
        """Whether ratio ``v`` is too high / too low (a ratio of exactly 0 is never "too low")."""
        return v > self._limit(step) if direction == "high" else 0.0 < v < self.low and not annealed

    def _annealed(self, record: Record, comp: Component) -> bool:
        """True while the component's LR is far below the largest seen (a schedule's end or start)."""
        key = comp.key("opt/lr")
        lrs = [v for k, v in record.scalars.items() if (k == key or k.startswith(key + "/")) and math.isfinite(v)]
        if not lrs:
            return False
        lr = max(lrs)
        top = self._max_lr[comp.name] = max(self._max_lr.get(comp.name, 0.0), lr)
        return lr < self.lr_fraction * top

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = []
        for comp in components:
            layers = {k: v for k, v in layer_values(record, comp.key("update/ratio")).items() if math.isfinite(v)}
            if not layers:
                continue
            annealed = self._annealed(record, comp)
            top = max(layers, key=layers.__getitem__)
            if layers[top] > self.extreme and self._streaks.count(f"{comp.name}|{top}|high") == 0:
                where = qualified(comp, top)
                self._streaks.mark(f"{comp.name}|{top}|high", record.step)  # the streak below will not repeat it
                out.append(self.make(record.step, f"update-to-weight ratio of {where} is {layers[top]:.3g} (> "
                                                  f"{self.extreme:g}) at step {record.step}: one step moved the weights "
                                                  f"{layers[top]:.0f}x their own size.", layers[top], self.extreme, where))
            for direction in ("high", "low"):
                due = [lay for lay, v in layers.items()
                       if self._streaks.bump(f"{comp.name}|{lay}|{direction}", self._off(direction, v, annealed, record.step), record.step)]
                if not due:
                    continue
                pick = max if direction == "high" else min
                worst = pick(due, key=lambda lay: layers[lay])
                v = layers[worst]
                where = qualified(comp, worst)
                start = self._streaks.start(f"{comp.name}|{worst}|{direction}")
                others = f" ({len(due)} layers in all)" if len(due) > 1 else ""
                if direction == "high":
                    msg = (f"update-to-weight ratio of {where} is {v:.3g} (> {self._limit(record.step):g}) for {self.patience} "
                           f"measurements{others}: each step rewrites a large part of the weights.")
                else:
                    msg = (f"update-to-weight ratio of {where} is {v:.3g} (< {self.low:g}) for {self.patience} "
                           f"measurements{others}: the layer is barely learning.")
                out.append(self.make(start, msg, v, self._limit(record.step) if direction == "high" else self.low, where))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**self._streaks.state_dict(), "max_lr": dict(self._max_lr)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)
        self._max_lr = dict(state.get("max_lr", {}))


class StaleParams(Rule):
    """Fires when a layer gets no gradient (``None`` or exactly zero: ``diag/grad/norm/<layer>`` == 0)
    or does not change at the optimizer step (``diag/update/ratio/<layer>`` == 0) at ``patience`` (5)
    consecutive measurements spanning at least ``min_steps`` (50) steps: frozen by mistake, a detached
    branch, an unused module, an LR of 0. Also when a component's optimizer has not stepped for
    ``min_steps`` steps while backward passes reach it (``update/idle_steps``: an ``optimizer.step()``
    the loop stopped calling): ``step`` is the first idle step, ``where`` the component.
    Layers excluded from the optimizer on purpose are not seen at all. ``where`` is the layer. Layers
    an optimizer holds with ``requires_grad=False`` (``setup/frozen``) are reported at once."""

    kind = "stale_params"
    severity = "warning"
    hint = ("Check requires_grad (frozen by mistake?), that the layer is used in forward and its parameters are in "
            "the optimizer, look for .detach(), .data, .item() or torch.no_grad() cutting the graph, and for a "
            "param group with lr=0. Unused on purpose: leave it out of the optimizer. If grad_flow or dead_units "
            "fire too, the gradient vanished to zero on its way back: fix that instead.")

    def __init__(self, *, patience: int = 5, min_steps: int = 50, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_steps = patience, min_steps
        self._streaks = Streaks(patience)
        self._idle_reported: dict[str, set[int]] = {}

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = self._idle(record, components) + self._frozen(record, components)
        for comp in components:
            grads = layer_values(record, comp.key("grad/norm"))
            ups = layer_values(record, comp.key("update/ratio"))
            for layer in dict.fromkeys([*grads, *ups]):
                no_grad, no_change = grads.get(layer) == 0.0, ups.get(layer) == 0.0
                if not self._streaks.bump(f"{comp.name}|{layer}", no_grad or no_change, record.step, self.min_steps):
                    continue
                where = qualified(comp, layer)
                why = ("receives no gradient (None or exactly zero)" if no_grad
                       else "does not change at the optimizer step (update 0)")
                msg = f"{where} {why} at every measurement since step {self._streaks.start(f'{comp.name}|{layer}')}."
                out.append(self.make(self._streaks.start(f"{comp.name}|{layer}"), msg, 0.0, 0.0, where))
        return out

    def _frozen(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """Parameters an optimizer holds that do not require a gradient (the ``setup`` probe): at once."""
        out = []
        for comp in components:
            table = record.tables.get(comp.key("setup/frozen"))
            if not table:
                continue
            where = layers_named(comp, table)
            msg = (f"{len(table)} layer(s) in the optimizer have requires_grad=False ({where}): they never get a "
                   f"gradient and never train. Frozen on purpose? Then leave them out of the optimizer.")
            for lay in table:  # the streak below must not report them again
                self._streaks.mark(f"{comp.name}|{lay}", record.step)
            out.append(self.make(record.step, msg, sum(table.values()), 0.0, where))
        return out

    def _idle(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """A component whose optimizer has not stepped for ``min_steps`` steps while it got gradients."""
        out = []
        for comp in components:
            n = record.scalars.get(comp.key("update/idle_steps"), 0.0)
            since = int(record.tables.get(comp.key("update/idle"), {}).get("since", record.step))
            if n >= self.min_steps and since not in self._idle_reported.get(comp.name, ()):
                self._idle_reported.setdefault(comp.name, set()).add(since)
                what = f"component {comp.name!r}" if comp.name else "the model"
                msg = (f"the optimizer of {what} has not stepped for {int(n)} steps (since step {since}) although "
                       f"backward passes keep reaching it: its parameters do not change.")
                out.append(self.make(since, msg, n, float(self.min_steps), comp.name or "(all layers)"))
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._streaks.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)

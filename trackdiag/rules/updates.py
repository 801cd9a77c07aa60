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
    """Update-to-weight ratios ||dw||/||w|| far from the ~1e-3 of healthy training:

    - the whole model's step (``update/step_size``: the ratio over the parameters that were not all zero
      when first measured; a zero-initialised logistic regression's second step is as large as the weights
      its first step made) above ``high`` (1.0) at one measurement: the step moved the weights by more than
      their own size, which no healthy run does (``unambiguous``, at once: a learning rate orders of magnitude
      too high from step 0);
    - one layer above ``high`` for ``patience`` (3) consecutive measurements (``persistent``): a
      param group with a wrong learning rate, a weight decay that flips the weights. One
      measurement alone is not enough for a layer: parameters initialised at or near zero
      (LayerScale, zero-initialised heads, LoRA's B) grow by more than their size at first;
    - a layer inside (0, ``low``) (1e-6) for ``patience`` measurements: an ``info`` finding (rarely
      touched embedding rows, an annealed schedule); a run that does not learn is ``not_learning``'s
      business. Not judged while the LR is below ``lr_fraction`` (1%) of its largest.
    Healthy runs of real scripts sit at 1e-4-0.5 (word_language_model's SGD at lr 20 with clipping at
    0.25 sits at 0.1-0.5 throughout). ``step`` is where it began; ``where`` the worst layer."""

    kind = "update_ratio"
    hint = ("A healthy update is ~1e-3 of the weights. Too large: lower the learning rate, add warm-up, clip "
            "gradients, check weight decay and the init scale. Too small: raise the learning rate (or check the "
            "schedule/param group), look for vanishing gradients or an over-large weight init.")

    def __init__(self, *, high: float = 1.0, extreme: float | None = None, low: float = 1e-6, patience: int = 3,
                 lr_fraction: float = 0.01, **kw: Any) -> None:
        super().__init__(**kw)
        self.high, self.low, self.patience, self.lr_fraction = high, low, patience, lr_fraction
        self.extreme = extreme  # accepted for older configs; the global ratio above ``high`` now fires at once
        self._streaks = Streaks(patience)
        self._global = Streaks(1)  # fires at the first measurement of a streak above ``high``
        self._max_lr: dict[str, float] = {}

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
            # the step against the weights that were not born zero (their first steps make them)
            g = record.scalars.get(comp.key("update/step_size"), record.scalars.get(comp.key("update/global_ratio"), math.nan))
            if math.isfinite(g) and self._global.bump(comp.name, g > self.high, record.step):
                top = max(layers, key=layers.__getitem__) if layers else ""
                where = qualified(comp, top) if top else comp.name
                msg = (f"one optimizer step moved the weights by {g:.3g}x their own size (update-to-weight ratio of the "
                       f"whole model; largest in {where or 'the model'}: {layers.get(top, g):.3g}).")
                out.append(self.make(record.step, msg, g, self.high, where, ["unambiguous"]))
            if not layers:
                continue
            annealed = self._annealed(record, comp)
            for direction in ("high", "low"):
                due = [lay for lay, v in layers.items()
                       if self._streaks.bump(f"{comp.name}|{lay}|{direction}", self._off(direction, v, annealed), record.step)]
                if due:
                    out.append(self._layer_finding(comp, layers, due, direction))
        return out

    def _off(self, direction: str, v: float, annealed: bool) -> bool:
        """Whether ratio ``v`` is too high / too low (a ratio of exactly 0 is never "too low")."""
        return v > self.high if direction == "high" else 0.0 < v < self.low and not annealed

    def _layer_finding(self, comp: Component, layers: dict[str, float], due: list[str], direction: str) -> Alert:
        worst = (max if direction == "high" else min)(due, key=lambda lay: layers[lay])
        v, where = layers[worst], qualified(comp, worst)
        start = self._streaks.start(f"{comp.name}|{worst}|{direction}")
        others = f" ({len(due)} layers in all)" if len(due) > 1 else ""
        if direction == "high":
            msg = (f"update-to-weight ratio of {where} is {v:.3g} (> {self.high:g}) for {self.patience} measurements"
                   f"{others}: each step rewrites that layer.")
            return self.make(start, msg, v, self.high, where, ["persistent"])
        msg = (f"update-to-weight ratio of {where} is {v:.3g} (< {self.low:g}) for {self.patience} measurements{others}: "
               f"the layer barely moves (rarely used rows of an embedding, or a learning rate too low for it).")
        return self.make(start, msg, v, self.low, where)

    def state_dict(self) -> dict[str, Any]:
        return {**self._streaks.state_dict(), "max_lr": dict(self._max_lr)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)
        self._max_lr = dict(state.get("max_lr", {}))


class StaleParams(Rule):
    """Parameters that do not train, by phase (``where`` = the layer, ``step`` = when the phase began):

    - **idle optimizer** (warning, ``persistent``): a component's optimizer has not stepped for
      ``min_steps`` (50) steps while backward passes keep reaching it (``update/idle_steps``: an
      ``optimizer.step()`` the loop stopped calling; its parameters never change);
    - **frozen** (info): layers an optimizer holds with ``requires_grad=False`` (``setup/frozen``):
      a backbone frozen on purpose and handed to the optimizer with the rest, which PyTorch handles;
    - **waiting** (info): a layer that has never received a gradient after ``min_steps`` steps and
      ``patience`` (5) measurements: a later phase (greedy layer-wise training), an unused module, or
      a ``.detach()`` cutting it off;
    - **stopped** (info): a layer that received gradients and then none (``None`` or exactly zero) or
      no longer changes (``update/ratio`` = 0) for ``min_steps`` steps and ``patience`` measurements:
      a phase that ended, or a layer frozen mid-run.
    Layers excluded from the optimizer on purpose are not seen at all."""

    kind = "stale_params"
    hint = ("Check requires_grad (frozen by mistake?), that the layer is used in forward and its parameters are in "
            "the optimizer, look for .detach(), .data, .item() or torch.no_grad() cutting the graph, and for a "
            "param group with lr=0. Unused on purpose: leave it out of the optimizer. An idle optimizer: the loop "
            "no longer calls its step().")

    def __init__(self, *, patience: int = 5, min_steps: int = 50, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_steps = patience, min_steps
        self._streaks = Streaks(patience)
        self._idle_reported: dict[str, set[int]] = {}
        self._trained: set[str] = set()  # layers that have had a non-zero gradient
        self._first: dict[str, int] = {}  # layer -> the step of its first measurement

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        out = self._idle(record, components) + self._frozen(record, components)
        for comp in components:
            grads = layer_values(record, comp.key("grad/norm"))
            ups = layer_values(record, comp.key("update/ratio"))
            for layer in dict.fromkeys([*grads, *ups]):
                key = f"{comp.name}|{layer}"
                self._first.setdefault(key, record.step)
                g = grads.get(layer)
                if g is not None and g > 0:
                    self._trained.add(key)
                no_grad, no_change = g == 0.0, ups.get(layer) == 0.0
                if not self._streaks.bump(key, no_grad or no_change, record.step, self.min_steps):
                    continue
                where, since = qualified(comp, layer), self._streaks.start(key)
                if key not in self._trained:
                    first = self._first.get(key, since)
                    when = (f"in any of the {record.step - since} steps since its first measurement (step {since})"
                            if since <= first else f"since step {since} ({record.step - since} steps)")
                    msg = (f"{where} has not received a gradient {when}: waiting for a later phase, unused in forward, "
                           f"or cut off by a .detach().")
                else:
                    why = "receives no gradient (None or exactly zero)" if no_grad else "no longer changes at the optimizer step"
                    msg = f"{where} trained earlier but {why} since step {since}: a phase that ended, or frozen mid-run."
                out.append(self.make(since, msg, 0.0, 0.0, where))
        return out

    def _frozen(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """Parameters an optimizer holds that do not require a gradient (the ``setup`` probe): at once, info."""
        out = []
        for comp in components:
            table = record.tables.get(comp.key("setup/frozen"))
            if not table:
                continue
            where = layers_named(comp, table)
            msg = (f"{len(table)} layer(s) in the optimizer have requires_grad=False ({where}) at this step: while frozen "
                   f"they get no gradient. Fine when frozen on purpose (a fine-tuned backbone; a GAN's discriminator "
                   f"frozen for the generator's step); otherwise unfreeze them.")
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
                out.append(self.make(since, msg, n, float(self.min_steps), comp.name or "(all layers)", ["persistent"]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**self._streaks.state_dict(), "trained": sorted(self._trained), "first": dict(self._first)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)
        self._trained = set(state.get("trained", []))
        self._first = {k: int(v) for k, v in state.get("first", {}).items()}

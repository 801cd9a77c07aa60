"""``stale_params``: parameters that do not train (layers that never get a gradient or never change, an
optimizer that stopped stepping, a model mostly frozen, steps that do not move the weights)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import torch
from torch import nn

from trackdiag.capture.components import stepped_inputs
from trackdiag.capture.context import Component
from trackdiag.capture.layers import layer_of
from trackdiag.capture.optimizers import real_optimizer
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent
from trackdiag.rules._streak import Streaks
from trackdiag.rules.base import VANISHED_LR, Rule, latest, layer_values, learning_rates, phase_start
from trackdiag.rules.gradients import loss_points
from trackdiag.util.modnames import layer_label, layers_named


def layer_sizes(comp: Component) -> dict[str, float]:
    """``{layer: values}`` of the parameters ``comp``'s optimizers hold. Cost: one host pass over them."""
    out: dict[str, float] = {}
    for name, p in zip(comp.index.names, comp.index.params):
        out[layer_of(name)] = out.get(layer_of(name), 0.0) + float(p.numel())
    return out


def converges_itself(comp: Component) -> bool:
    """An L-BFGS optimizer skips the update once its own tolerances say converged (``tolerance_grad``,
    ``tolerance_change``): weights that stop moving under it are a finished fit, not an update that did not land."""
    return any(isinstance(real_optimizer(o) or o, torch.optim.LBFGS) for o in comp.optimizers)


def orphaned(comp: Component) -> bool:
    """Whether ``comp``'s optimizers hold only tensors its model no longer uses, none with a gradient, while the
    model has trainable parameters (each replaced after the optimizer was built: ``layer.weight = nn.Parameter(...)``).
    An input optimised on purpose (style transfer, adversarial examples) has a gradient. Cost: one pass over the
    parameter ids, on the logging steps that measure the update."""
    held = stepped_inputs(comp)
    return bool(held) and all(p.grad is None for p in held) and any(p.requires_grad for p in comp.model.parameters())


def branch_not_taken(comp: Component, layer: str, grads: dict[str, float]) -> bool:
    """Whether ``layer`` sits in one of the parallel branches of an ``nn.ModuleList``/``nn.ModuleDict`` whose other
    branches train (a mixture-of-experts' expert no token was routed to, a head of a task not sampled): a forward
    that routes around it, not a cut. Layers of an ``nn.Sequential`` (always run in order) are never branches, nor
    is a branch some of whose own layers train (a transformer block whose MLP alone is cut off by a ``.detach()``).
    Cost: a few ``get_submodule`` look-ups per never-trained layer, on the logging steps that judge it."""
    parts = layer.split(".")
    for i in range(1, len(parts)):
        container, branch = ".".join(parts[:i]), ".".join(parts[:i + 1])
        try:
            holder = comp.model.get_submodule(container) if comp.model is not None else None
        except AttributeError:
            return False
        if isinstance(holder, (nn.ModuleList, nn.ModuleDict)) and any(
                v > 0 and lay.startswith(container + ".") and not lay.startswith(branch + ".") and lay != branch
                for lay, v in grads.items()):
            return not any(v > 0 for lay, v in grads.items() if lay.startswith(branch + ".") or lay == branch)
    return False


def _share(x: float) -> str:
    """A share as a percentage that does not round to 100 % (or 0 %) unless it is: a head of 0.03 % of the values left
    trainable is "99.97%", not "100%"."""
    for digits in range(4):
        text = f"{x:.{digits}%}"
        if (x >= 1.0 or not text.startswith("100")) and (x <= 0.0 or float(text[:-1]) > 0):
            return text
    return f"{x:.4%}"


class StaleParams(Rule):
    """Parameters that do not train, by phase (``where`` = the layer, ``step`` = when the phase began):

    - **idle optimizer** (warning, ``persistent``): a component's optimizer has not stepped for
      ``min_steps`` (50) steps while backward passes keep reaching it (``update/idle_steps``: an
      ``optimizer.step()`` the loop stopped calling; its parameters never change);
    - **still** (warning, ``persistent``): the optimizer steps, gradients reach the component, and its
      weights do not move at all (``update/global_ratio`` exactly 0) for ``min_steps`` steps and ``patience``
      measurements: a learning rate of 0, an optimizer holding only tensors the model no longer uses, a
      patched or compiled step that skips the update (not under L-BFGS, which stops itself once converged);
    - **frozen** (info): layers an optimizer holds with ``requires_grad=False`` (``setup/frozen``):
      a backbone frozen on purpose and handed to the optimizer with the rest, which PyTorch handles.
      A warning (``loss``) when they are more than ``FROZEN_SHARE`` (half) of the values the optimizer holds
      and the loss stalls: judged once, at the first logging step ``min_steps`` after the freeze was seen, its mean
      over the last ``LATE`` (20) steps is within ``STALL`` (0.9) .. 1/``STALL`` x its mean over the first ``EARLY``
      (10) (a fine-tuning slip: everything frozen but the last layer; a loss that rose is another rule's business; a
      loss at the task's chance level is said to be, with the labels named too: a frozen backbone trained on
      purpose on shuffled labels stalls there as well). A deliberate fine-tune learns quickly on its good backbone; a loss not minimised
      (GAN, RL) is not judged, nor a stall while the model input is one value everywhere (``constant_inputs``'s);
    - **waiting** (info): a layer that has never received a gradient after ``min_steps`` steps and
      ``patience`` (5) measurements: a later phase (greedy layer-wise training), an unused module, or
      a ``.detach()`` cutting it off. A warning (``persistent``) when nothing explains it: the component
      has one optimizer or none (a hand-written update), it steps (not idle), no training phase has begun in the
      run (``diag/phase``), other layers receive gradients, and the layers waiting since their first measurement
      hold at least ``CUT_SHARE`` (5%) of the optimised values or include the model's first layer (a cut-off part
      of the network, the input side cut from the layers that train by a ``.detach()``, not an unused pooler or
      auxiliary head), counting no layer of a parallel branch whose siblings train (:func:`branch_not_taken`: an
      expert no token reached);
    - **stopped** (info): a layer that received gradients and then none (``None`` or exactly zero) or
      no longer changes (``update/ratio`` = 0) for ``min_steps`` steps and ``patience`` measurements:
      a phase that ended, or a layer frozen mid-run. A measurement where every layer's gradient is exactly
      zero (an exactly-zero loss: nothing mined by a triplet or margin loss) is no evidence either way.
    Layers excluded from the optimizer on purpose are not seen at all. Host work on logging steps only."""

    kind = "stale_params"
    hint = ("Check requires_grad (frozen by mistake?), that the layer is used in forward and its parameters are in "
            "the optimizer, look for .detach(), .data, .item() or torch.no_grad() cutting the graph, and for a "
            "param group with lr=0. Unused on purpose: leave it out of the optimizer. An idle optimizer: the loop "
            "no longer calls its step().")

    #: evidence lines (constants, not config options; see the class docstring)
    CUT_SHARE, FROZEN_SHARE, STALL, EARLY, LATE = 0.05, 0.5, 0.9, 10, 20

    def __init__(self, *, patience: int = 5, min_steps: int = 50, **kw: Any) -> None:
        super().__init__(**kw)
        self.patience, self.min_steps = patience, min_steps
        self._streaks = Streaks(patience)
        self._idle_reported: dict[str, set[int]] = {}
        self._trained: set[str] = set()  # layers that have had a non-zero gradient
        self._first: dict[str, int] = {}  # layer -> the step of its first measurement
        self._phased = False  # a training phase began in the run (an optimizer's first step after step 0, ...)
        self._sizes: dict[str, tuple[int, dict[str, float]]] = {}  # component -> (generation, layer sizes)
        self._cold: dict[str, tuple[int, float, str]] = {}  # component -> (step, frozen share, where) while frozen
        self._loss: dict[str, Recent] = {}  # the last ``LATE`` losses of a mostly frozen component
        self._early: dict[str, dict[int, float]] = {}  # its first ``EARLY`` losses by step
        self._stall_said: set[str] = set()
        self._chance = math.nan  # the loss a model that learned nothing sits at (diag/task/chance_loss), when shown
        self._lr_peak: dict[str, float] = {}  # component -> the largest learning rate it was stepped with

    def _size(self, comp: Component) -> dict[str, float]:
        got = self._sizes.get(comp.name)
        if got is None or got[0] != comp.generation:
            got = self._sizes[comp.name] = (comp.generation, layer_sizes(comp))
        return got[1]

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        self._phased = self._phased or phase_start(record) >= 0
        self._chance = record.scalars.get("diag/task/chance_loss", self._chance)  # the task's, once shown
        for comp in components:
            lrs = learning_rates(record, comp).values()
            if lrs and max(lrs) > self._lr_peak.get(comp.name, 0.0):
                self._lr_peak[comp.name] = max(lrs)
        out = self._idle(record, components) + self._frozen(record, components) + self._still(record, components)
        if not record.scalars.get("diag/data/inputs_constant_steps", 0.0):  # a stall on one-value inputs is theirs
            out += self._stalled(record, components)
        for comp in components:
            grads = layer_values(record, comp.key("grad/norm"))
            ups = layer_values(record, comp.key("update/ratio"))
            # every layer's gradient exactly zero: the loss gave no signal at this step (a margin or triplet loss
            # with nothing mined is an exact 0); no layer is singled out, so none is judged by its gradient
            silent = len(grads) > 1 and not any(grads.values())
            for layer in dict.fromkeys([*grads, *ups]):
                key = f"{comp.name}|{layer}"
                self._first.setdefault(key, record.step)
                g = grads.get(layer)
                if g is not None and g > 0:
                    self._trained.add(key)
                no_grad, no_change = g == 0.0 and not silent, ups.get(layer) == 0.0
                if silent and not no_change:
                    continue  # neither evidence nor counter-evidence: the streak waits
                if not self._streaks.bump(key, no_grad or no_change, record.step, self.min_steps):
                    continue
                where, since = layer_label(comp, layer), self._streaks.start(key)
                evidence: list[str] = []
                if key not in self._trained:
                    first = self._first.get(key, since)
                    when = (f"in any of the {record.step - since} steps since its first measurement (step {since})"
                            if since <= first else f"since step {since} ({record.step - since} steps)")
                    cut = self._cut_off(record, comp, grads, layer) if since <= first else ""
                    evidence = ["persistent"] if cut else []
                    msg = (f"{where} has not received a gradient {when}: " + (cut or "waiting for a later phase, "
                           "unused in forward, or cut off by a .detach()."))
                else:
                    why = "receives no gradient (None or exactly zero)" if no_grad else "no longer changes at the optimizer step"
                    msg = f"{where} trained earlier but {why} since step {since}: a phase that ended, or frozen mid-run."
                out.append(self.make(since, msg, 0.0, 0.0, where, evidence))
        return out

    def _cut_off(self, record: Record, comp: Component, grads: dict[str, float], layer: str) -> str:
        """Why ``layer``, which never had a gradient, is a fault, or "" when something may explain it (see class doc):
        one of the layers cut off, not a branch the forward routes around while others are."""
        if (len(comp.optimizers) > 1 or self._phased or comp.key("update/idle_steps") in record.scalars
                or not any(v > 0 for v in grads.values())):
            return ""
        sizes = self._size(comp)
        cut = [lay for lay, v in grads.items() if v == 0.0 and f"{comp.name}|{lay}" not in self._trained
               and not branch_not_taken(comp, lay, grads)]
        total = sum(sizes.values())
        share = sum(sizes.get(lay, 0.0) for lay in cut) / total if total else 0.0
        # the model's first layer among them: the input side is cut from the layers that train (a .detach() between
        # them), however few values it holds (pytorch/examples' mnist: its two convolutions are 1.6 % of them); an
        # unused module (a pooler, an auxiliary head) sits after the layers that train or beside them
        first = bool(comp.index.layers) and comp.index.layers[0] in cut
        if layer not in cut or share < self.CUT_SHARE and not first:
            return ""
        stepped = "its optimizer steps" if comp.optimizers else "its parameters are updated"
        where = "including its first layer, " if first else ""
        return (f"{stepped} at every step and the other layers train, with no phase to wait for; "
                f"{len(cut)} layer(s) {where}holding {share:.1%} of the optimised values "
                f"({layers_named(comp, dict.fromkeys(cut, 1.0))}) are cut off: a .detach(), .data or torch.no_grad() in "
                f"forward, or a module the forward no longer calls.")

    def _still(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """Components whose optimizer steps and gets gradients while their weights do not move at all."""
        out = []
        for comp in components:
            g = record.scalars.get(comp.key("update/global_ratio"))
            if g is None:
                continue
            grad = latest(record, comp.key("grad/global_norm"))
            key = f"{comp.name}|(still)"
            lost = g == 0.0 and not grad and orphaned(comp)  # the gradients reach the model's new tensors, not these
            moving = not (g == 0.0 and (lost or grad is not None and grad > 0)
                          and comp.key("update/idle_steps") not in record.scalars and not converges_itself(comp))
            if not self._streaks.bump(key, not moving, record.step, self.min_steps):
                continue
            since = self._streaks.start(key)
            for lay in layer_values(record, comp.key("update/ratio")):  # said once here, not once per layer
                self._streaks.mark(f"{comp.name}|{lay}", since)
            lrs = list(learning_rates(record, comp).values())
            peak = self._lr_peak.get(comp.name, 0.0)
            why = ("its learning rate is 0" if lrs and max(lrs) == 0.0 else
                   f"its learning rate is {max(lrs):.2g}, {max(lrs) / peak:.0e} of its peak {peak:.3g}: too small to change "
                   f"a weight" if lrs and max(lrs) < VANISHED_LR * peak else "the optimizer holds only tensors the "
                   "model no longer uses: none is a parameter of the model, none gets a gradient; build the optimizer "
                   "after the last change to the model's parameters" if lost else
                   "the optimizer holds tensors the model no longer uses, or its step is patched or compiled away")
            what = f"component {comp.name!r}" if comp.name else "the model"
            reach = "the model's parameters, not the tensors it steps" if lost else "it"
            msg = (f"the optimizer of {what} steps and gradients reach {reach}, but its weights have not moved at all since "
                   f"step {since} ({record.step - since} steps): the updates do not land ({why}).")
            out.append(self.make(since, msg, 0.0, 0.0, comp.name or "(all layers)", ["persistent"]))
        return out

    def _frozen(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """Parameters an optimizer holds that do not require a gradient (the ``setup`` probe): at once, info."""
        out = []
        for comp in components:
            table = record.tables.get(comp.key("setup/frozen"))
            if not table:
                if phase_start(record) >= 0:
                    self._cold.pop(comp.name, None)  # re-indexed with nothing frozen: unfrozen
                continue
            where = layers_named(comp, table)
            total = sum(self._size(comp).values())
            self._cold[comp.name] = (record.step, sum(table.values()) / total if total else 0.0, where)
            self._early.pop(comp.name, None)  # a new freeze: its loss judged from here
            self._loss.pop(comp.name, None)
            msg = (f"{len(table)} layer(s) in the optimizer have requires_grad=False ({where}) at this step: while frozen "
                   f"they get no gradient. Fine when frozen on purpose (a fine-tuned backbone; a GAN's discriminator "
                   f"frozen for the generator's step); otherwise unfreeze them.")
            for lay in table:  # the streak below must not report them again
                self._streaks.mark(f"{comp.name}|{lay}", record.step)
            out.append(self.make(record.step, msg, sum(table.values()), 0.0, where))
        return out

    def _stalled(self, record: Record, components: Sequence[Component]) -> list[Alert]:
        """Most of a component frozen while its loss stalls (see class doc): once per component, ``loss``."""
        out = []
        for comp in components:
            cold = self._cold.get(comp.name)
            decided = f"{comp.name}|{cold[0]}" if cold else ""
            if cold is None or cold[1] <= self.FROZEN_SHARE or decided in self._stall_said or not self.minimised(comp.name):
                continue
            loss = self._loss.setdefault(comp.name, Recent(self.LATE))
            first = self._early.setdefault(comp.name, {})
            for s, v in loss_points(record, comp):
                if s >= cold[0] + self.EARLY:
                    loss.extend([(s, v)])
                elif s >= cold[0]:
                    first[s] = v
            early, late = list(first.values()), [v for _, v in loss.points]
            if record.step < cold[0] + self.min_steps or len(early) < self.EARLY // 2 or len(late) < self.LATE // 2:
                continue
            self._stall_said.add(decided)  # judged once, at the first logging step that can: a stall, not a later rise
            a, b = statistics.fmean(early), statistics.fmean(late)
            if not (math.isfinite(a) and math.isfinite(b)) or not self.STALL * a <= b <= a / self.STALL:
                continue
            msg = (f"{_share(cold[1])} of the values the optimizer holds are frozen (requires_grad=False: {cold[2]}) and the "
                   f"loss stalls: {b:.4g} over the last {len(late)} steps against {a:.4g} over the first {len(early)}. "
                   f"A fine-tuning slip (everything frozen but the last layer)? Unfreeze what should train.")
            if self._chance > 0 and abs(b / self._chance - 1) <= 1 - self.STALL:  # the model learns nothing at all
                msg += (f" The loss sits at the task's chance level ({self._chance:.4g}): if the frozen part was "
                        f"trained on purpose, check the labels instead (shuffled or misaligned with the inputs).")
            out.append(self.make(cold[0], msg, cold[1], self.FROZEN_SHARE, cold[2], ["loss"]))
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
        return {**self._streaks.state_dict(), "trained": sorted(self._trained), "first": dict(self._first),
                "phased": self._phased, "stall_said": sorted(self._stall_said),
                "cold": {k: list(v) for k, v in self._cold.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._streaks.load_state_dict(state)
        self._trained = set(state.get("trained", []))
        self._first = {k: int(v) for k, v in state.get("first", {}).items()}
        self._phased = bool(state.get("phased", False))
        self._stall_said = set(state.get("stall_said", []))
        self._cold = {k: (int(v[0]), float(v[1]), str(v[2])) for k, v in state.get("cold", {}).items()}

"""``grad_explosion``: jumps of the gradient norm, judged against the run's own history.

No absolute number decides by default: a VAE whose loss is a per-batch sum has healthy gradient
norms in the thousands, a fine-tuned model's in the thousandths. A jump is measured against the
run's own recent norms (:class:`~trackdiag.rules._spike.SpikeDetector`), and how loud it is comes
from what followed it (:mod:`trackdiag.core.policy`): a one-step spike after which the loss and the
norms are back where they were is an ``info`` finding; one that persists, moves the loss or the
weights is a warning or critical. ``threshold`` / ``layer_threshold`` add the user's own absolute lines.
A component whose objective is not minimised (a GAN's generator and discriminator, an RL agent) moves its
gradient level and its loss as the game goes (a saturated discriminator becoming contested: 10-20x, for good):
there only signals from outside the game count (a non-finite loss, a learning rate raised 10x or more just
before, an update larger than the weights, 1000x, your threshold).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules._recent import Recent, reacted
from trackdiag.rules._shift import Shift, after_shift, lr_raised, recovered, told
from trackdiag.rules._spike import SpikeDetector
from trackdiag.rules._weights import weights_moved
from trackdiag.rules.base import Rule, layer_values, phase_start, points_of
from trackdiag.util.modnames import layer_label


def loss_points(record: Record, comp: Component) -> list[tuple[int, float]]:
    """The every-step loss of ``comp``: its own series, else the run's single loss."""
    return record.series.get(comp.key("loss")) or record.series.get("diag/loss", [])


def largest_layer(records: Sequence[Record], comp: Component, lo: int, hi: int) -> tuple[str, int]:
    """The layer with the largest gradient norm at the first step in ``lo..hi`` whose per-layer norms
    were measured, and that step; ``("", -1)`` when none was (they are measured on logging steps)."""
    for rec in records:
        if lo <= rec.step <= hi:
            layers = {k: v for k, v in layer_values(rec, comp.key("grad/norm")).items() if math.isfinite(v)}
            if layers:
                return layer_label(comp, max(layers, key=layers.__getitem__)), rec.step
    return "", -1


@dataclass
class _Comp:
    det: SpikeDetector
    grad: Recent = field(default_factory=Recent)
    loss: Recent = field(default_factory=Recent)
    pending: list[tuple[int, float, float]] = field(default_factory=list)  # (step, value, the level before)
    shifted: dict[int, Shift | None] = field(default_factory=dict)  # pending step -> its data-change signature
    episode: float = 0.0  # the level before the jump being followed (0: none): later values above it are the same jump


class GradExplosion(Rule):
    """A jump of the pre-clip global gradient norm (every step) against the run's own history: more
    than ``spike_z`` (6) standard deviations above the mean of the last ``window`` (128) norms AND
    more than ``spike_factor`` (10) x their recent level (the median of the last 20, floored at
    ``floor_fraction``, 0.1, of the first ``warmup``, 20, norms). Judged ``settle`` (5) steps later: ``persistent`` when at least 3 of them
    stay above ``persist_factor`` (3) x the old level (and fewer than 2 of the ``settle`` steps before it did: a
    jump amid others is the same heavy tail, not a change); ``loss`` when the loss of the following
    steps rose or went non-finite (:func:`~trackdiag.rules._recent.reacted`; the spike step's own loss
    does not count: an unusual batch has a high loss and a high gradient at once); ``weights`` when an update-to-weight ratio
    above 1 was measured. ``threshold`` / ``layer_threshold`` (default none): absolute lines of your
    own, crossing them counts as ``corroborated``; a jump over ``unambiguous`` (1000) x the level is
    ``unambiguous`` (no odd batch does that). ``step`` is the exact step; ``where`` names the
    largest layer where per-layer norms were measured at that step (for a lasting jump: at the first
    logging step after it, said in the message), else the component. Jumps of one component are one
    incident; a jump lasts until the norm is back under ``persist_factor`` x its old level."""

    kind = "grad_explosion"
    hint = ("Clip gradients (torch.nn.utils.clip_grad_norm_(params, 1.0)), lower the learning rate or add "
            "warm-up, check the initialisation, add normalisation layers (BatchNorm/LayerNorm). A lone spike "
            "the loss shrugged off is usually one unusual batch.")

    def __init__(self, *, threshold: float | None = None, layer_threshold: float | None = None, spike_factor: float = 10.0,
                 spike_z: float = 6.0, window: int = 128, warmup: int = 20, floor_fraction: float = 0.1,
                 settle: int = 5, persist_factor: float = 3.0, unambiguous: float = 1000.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.threshold, self.layer_threshold, self.unambiguous = threshold, layer_threshold, unambiguous
        self.spike = dict(z=spike_z, factor=spike_factor, window=window, warmup=warmup, floor_fraction=floor_fraction)
        self.settle, self.persist_factor = max(1, settle), persist_factor
        self._c: dict[str, _Comp] = {}
        self._keys: dict[tuple[int, str], str] = {}
        self.follow_until = -1  # the session logs every step up to here: a pending spike is judged sooner

    def incident_key(self, alert: Alert) -> str:
        """Spikes of one component are one incident, whichever layer each names."""
        return self._keys.get((alert.step, alert.where), alert.where)

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, history, components, final=False)

    def at_close(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        return self._judge(record, history, components, final=True)

    def _judge(self, record: Record, history: Sequence[Record], components: Sequence[Component], final: bool) -> list[Alert]:
        out: list[Alert] = []
        for comp in components:
            st = self._c.get(comp.name)
            if st is None:
                st = self._c[comp.name] = _Comp(SpikeDetector(**self.spike))
            ps = phase_start(record)
            if ps >= 0:  # a new phase (a new optimizer, parameters joining): judged against its own history
                st = self._c[comp.name] = _Comp(SpikeDetector(**self.spike))
            points = [p for p in points_of(record, comp.key("grad/global_norm")) if p[0] >= ps]
            st.grad.extend(points)
            for step, gn in points:
                spike, ref = st.det.feed(gn, level=self.threshold is not None)
                user = self.threshold is not None and math.isfinite(gn) and gn > self.threshold
                if st.episode > 0 and math.isfinite(gn) and gn < self.persist_factor * st.episode and not user:
                    st.episode = 0.0  # back to its level: the next jump is a new incident
                if (spike or user) and st.episode == 0.0:
                    st.episode = ref if math.isfinite(ref) and ref > 0 else gn
                    st.pending.append((step, gn, ref if math.isfinite(ref) else gn))
            st.loss.extend(p for p in loss_points(record, comp) if p[0] >= ps)
            while st.pending and (final or self._ready(st, st.pending[0][0], history, record, comp)):
                out.append(self._verdict(st, st.pending.pop(0), history, record, comp))
            out += self._layers(record, comp)
        self.follow_until = max((p[0] + self.settle for st in self._c.values() for p in st.pending
                                 if p[0] not in st.shifted), default=-1)
        return out

    def _ready(self, st: _Comp, step: int, history: Sequence[Record], record: Record, comp: Component) -> bool:
        """Whether the jump at ``step`` can be judged: ``settle`` steps after it, or its data-change signature's
        horizon after that jump (:mod:`~trackdiag.rules._shift`: decided at ``settle``)."""
        last = st.grad.last_step
        if step + self.settle > last:
            return False
        if step not in st.shifted:
            st.shifted[step] = after_shift(st.loss, st.grad, step, [*history, record], comp.key("opt/lr"))
        sh = st.shifted[step]
        return sh is None or sh.step + sh.horizon <= last

    def _verdict(self, st: _Comp, spike: tuple[int, float, float], history: Sequence[Record], record: Record,
                 comp: Component) -> Alert:
        step, gn, ref = spike
        sh = st.shifted.pop(step, None)
        if sh is not None and (fell := recovered(st.loss, st.grad, sh.step, sh.horizon)) is not None:
            at = sh.step
            loss_at = st.loss.between(at, at)[0]
            when = "at one step" if at == step else f"at step {at}, {step - at} step(s) before this jump"
            msg = (f"the pre-clip global gradient norm jumped to {gn:.3g} ({gn / ref:.1f}x its recent level "
                   f"{ref:.3g}); the loss ({loss_at:.3g}) and the norm jumped together {when}, {told(fell, sh.horizon)}")
            return self.make(step, msg, gn, self.spike["factor"] * ref, comp.name, [])
        after = st.grad.between(step + 1, step + self.settle)
        high = sum(v >= self.persist_factor * ref or not math.isfinite(v) for v in after)
        evidence = []
        records = [*history, record]
        minimised, lr_up = self.minimised(comp.name), False
        # the norm already jumping before it (2 or more of the steps before above persist_factor x the level): heavy
        # tails (free-running BPTT, scheduled sampling), not a change at this step; what follows then shows no persistence
        before = st.grad.between(step - self.settle, step - 1)
        jumpy = sum(math.isfinite(v) and v >= self.persist_factor * ref for v in before) >= 2
        if minimised:
            if high >= min(3, max(len(after), 1)) and after and not jumpy:
                evidence.append("persistent")
            if reacted(st.loss, step + 1, self.settle - 1):  # after it: an odd batch has a high loss of its own
                evidence.append("loss")
        else:  # a GAN's or an RL agent's: the game moves the gradient level and the loss (a saturated discriminator
            # becoming contested: 10-20x, for good); only signals from outside the game count
            if not all(math.isfinite(v) for v in st.loss.between(step + 1, step + self.settle)):
                evidence.append("loss")
            lr_up = bool(lr_raised(records, comp.key("opt/lr"), step, factor=10.0))
        user = self.threshold is not None and gn > self.threshold
        if lr_up or user:
            evidence.append("corroborated")
        if weights_moved(records, comp.name, step, step + self.settle):
            evidence.append("weights")
        if ref > 0 and gn >= self.unambiguous * ref:  # no odd batch moves a gradient a thousandfold
            evidence.append("unambiguous")
        jump = f"{gn / ref:.1f}x its recent level {ref:.3g}" if ref > 0 else f"{gn:.3g}"
        # a lasting explosion is located at the first step its layers were measured; a lone spike only at its own step
        where, at = largest_layer(records, comp, step, record.step if "persistent" in evidence else step)
        if evidence:
            what = ", ".join(w for w, on in (("it stayed high", "persistent" in evidence),
                                            ("the loss reacted" if minimised else "the loss went non-finite", "loss" in evidence),
                                            ("the learning rate was raised 10x or more just before", lr_up),
                                            ("the weights moved more than their size", "weights" in evidence),
                                            (f"above your threshold {self.threshold}", user),
                                            (f"over {self.unambiguous:g}x", "unambiguous" in evidence)) if on)
            msg = f"the pre-clip global gradient norm jumped to {gn:.3g} ({jump}); {what}."
            if where and at != step:
                msg += f" At step {at} the largest gradient is in {where}."
        elif not after:
            msg = f"the pre-clip global gradient norm jumped to {gn:.3g} ({jump}) at the run's last steps."
        elif jumpy:
            msg = (f"the pre-clip global gradient norm jumped to {gn:.3g} ({jump}) in a stretch where it was already "
                   f"jumping (heavy-tailed gradients; the loss did not react): clip_grad_norm_ keeps such steps in bounds.")
        else:
            msg = (f"a one-step spike of the pre-clip global gradient norm to {gn:.3g} ({jump}); the loss and the "
                   f"next {self.settle} steps were unaffected.")
        alert = self.make(step, msg, gn, self.spike["factor"] * ref, where or comp.name, evidence)
        if len(self._keys) > 1024:
            self._keys.clear()
        self._keys[(alert.step, alert.where)] = f"component:{comp.name}"
        return alert

    def _layers(self, record: Record, comp: Component) -> list[Alert]:
        if self.layer_threshold is None:
            return []
        layers = layer_values(record, comp.key("grad/norm"))
        over = {k: v for k, v in layers.items() if math.isfinite(v) and v > self.layer_threshold}
        if not over:
            return []
        worst = max(over, key=over.__getitem__)
        where = layer_label(comp, worst)
        return [self.make(record.step, f"gradient norm of {where} is {over[worst]:.3g} (> your limit {self.layer_threshold:g}).",
                          over[worst], self.layer_threshold, where, ["corroborated"])]

    def state_dict(self) -> dict[str, Any]:
        return {k: st.det.state_dict() for k, st in self._c.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, s in state.items():
            if isinstance(s, dict) and "recent" in s:
                self._c.setdefault(k, _Comp(SpikeDetector(**self.spike))).det.load_state_dict(s)

"""What probes see of the session: the components, the step, the schedule."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from torch import nn

from trackdiag.capture.layers import LayerIndex
from trackdiag.capture.resteps import Resteps


@dataclass
class Recreations:
    """An optimizer created anew over the same parameters, step after step (:func:`~trackdiag.capture.components.
    replaced`): what ``optimizer_recreated`` judges (published by the ``lr`` probe)."""

    streak: int = 0  # the component's optimizer steps in a row, each by a new optimizer that replaced the last one
    since: int = -1  # the step the streak began at
    steps: int = 0  # the component's optimizer steps so far (counted by the session's pre-step hook)
    at: int = -1  # ``steps`` when the latest replacement stepped
    total: int = 0
    kind: str = ""  # the optimizer's class
    stateful: bool = False  # a replaced optimizer held state (moments, momentum) that the new one starts without

    def replaced(self, step: int, kind: str, had_state: bool) -> None:
        """A new optimizer took the place of the last one and steps now (before ``steps`` counts this step)."""
        if self.streak and self.at == self.steps - 1:
            self.streak += 1
        else:
            self.streak, self.since = 1, step
        self.at, self.kind = self.steps, kind
        self.total += 1
        self.stateful = self.stateful or had_state

    def current(self) -> int:
        """The streak, when the component's latest optimizer step was a replacement; else 0."""
        return self.streak if self.streak and self.at >= self.steps - 1 else 0


@dataclass
class Component:
    """One named model with the optimizer(s) that step it (``name == ""`` for a single model).

    ``optimizer``: the first optimizer that really steps it (found behind wrappers; for the LR and
    the set-up checks), or None. ``optimizers``: every such optimizer (hookable ones: torch's step
    hooks run for them). ``given``: what the user passed (wrappers included). ``generation`` grows
    each time ``index`` is rebuilt (param groups added, layers unfrozen).
    """

    name: str
    model: nn.Module | None
    optimizer: Any
    index: LayerIndex
    given: list[Any] = field(default_factory=list)
    optimizers: list[Any] = field(default_factory=list)
    generation: int = 0
    signature: tuple[Any, ...] = ()
    groups: tuple[Any, ...] = ()
    #: the model as the user passed it (a DDP or ``torch.compile`` wrapper included): forward calls
    #: are watched on it, while ``model`` is the module inside
    outer: Any = None
    #: the step at which the optimizers' param groups were last compared with ``groups`` (once per step is enough)
    refreshed: int = -1
    #: optimizers that took the place of one of the same class over the same parameters (the loop creates it anew)
    recreations: Recreations = field(default_factory=Recreations)
    #: optimizer steps that found the gradients of the same optimizer's step before (``optimizer.step()`` twice)
    resteps: Resteps = field(default_factory=Resteps)

    def key(self, suffix: str) -> str:
        """The metric key of ``suffix`` for this component: ``diag/[<name>/]<suffix>``."""
        return f"diag/{self.name}/{suffix}" if self.name else f"diag/{suffix}"

    def add_optimizer(self, opt: Any) -> bool:
        """Adopt ``opt`` (or the optimizer it wraps); True if it is new to this component."""
        from trackdiag.capture.optimizers import param_groups, real_optimizer

        if all(opt is not g for g in self.given):
            self.given.append(opt)
        real = real_optimizer(opt)
        new = real is not None and all(real is not o for o in self.optimizers)
        if new:
            self.optimizers.append(real)
        self.optimizer = self.optimizers[0] if self.optimizers else next((g for g in self.given if param_groups(g)), None)
        return new

    def retire(self, opt: Any) -> None:
        """Let go of ``opt`` (a newer optimizer over the same parameters took its place): kept, a loop that creates
        its optimizer every step would keep every one alive, with its state."""
        from trackdiag.capture.optimizers import real_optimizer

        self.optimizers = [o for o in self.optimizers if o is not opt]
        self.given = [g for g in self.given if g is not opt and real_optimizer(g) is not opt]
        self.optimizer = self.optimizers[0] if self.optimizers else None

    def owns(self, opt: Any) -> bool:
        """True when ``opt`` is one of this component's (real) optimizers."""
        return any(opt is o for o in self.optimizers)


def component_of(key: str, suffix: str) -> str:
    """The component a metric key ``diag/[<name>/]<suffix>`` belongs to (:meth:`Component.key` read backwards):
    ``name``, or ``""`` for the single model (and for a key outside ``diag/``)."""
    return key[len("diag/"):-len(suffix)].rstrip("/") if key.startswith("diag/") else ""


@dataclass
class StepInputs:
    """What the user passed to ``Diagnostics.step``; losses and outputs keyed by component."""

    losses: Mapping[str, Any]
    outputs: Any = None
    batch: Any = None
    batch_size: int | None = None


@dataclass
class ProbeContext:
    """Shared, mutable view of the session the probes read. ``step`` is the optimizer step in
    progress; ``is_due(schedule)`` answers whether a schedule fires at it (anomaly windows included)."""

    components: list[Component]
    every: int
    layer_budget: int
    scaler: Any = None
    output_dir: Path | None = None
    step: int = 0
    anomaly_until: int = -1
    extra: dict[str, Any] = field(default_factory=dict)
    #: seconds spent in trackdiag's forward/backward hooks since the last logging step (they run inside
    #: the user's forward/backward, so the session's own clock does not see them)
    hook_seconds: float = 0.0
    #: components whose optimizer stepped in the step being recorded (set at ``Diagnostics.step``)
    stepped: set[str] = field(default_factory=set)
    #: components some backward pass reached in that step
    backward_seen: set[str] = field(default_factory=set)
    #: backward passes per component in that step (> 1: gradient accumulation, or micro-batches merged)
    passes: dict[str, int] = field(default_factory=dict)
    #: some part of a model is compiled (``torch.compile``): no module hooks, replays run eager
    compiled: bool = False
    #: what a probe cannot measure in this loop, once each (``summary()["notes"]``)
    notes: dict[str, str] = field(default_factory=dict)
    #: training phases so far (0: the first) and the step the newest began (see ``session_steps``)
    phase: int = 0
    phase_start: int = 0
    #: the user's loss computation, ``loss_fn(batch) -> loss`` (:mod:`trackdiag.capture.user_loss`), or None
    loss_fn: Callable[[Any], Any] | None = None
    #: the losses given to the step being logged, as ``step()`` got them (graph and all), during its logging step
    #: only (None otherwise: nothing holds a graph past its step); a probe may walk them there (``grad/reach``)
    losses: Mapping[str, Any] | None = None
    #: ``() -> [(Component, Tap)]``: the measurements of backward passes not handed to the probes yet (the other
    #: components a pass reached, whose optimizers step later): a check made at one component's step can read them too
    waiting: Callable[[], list[tuple[Component, Any]]] | None = None

    #: the step plan (``session/step_plan.py``): no schedule whose ``id`` is in ``planned`` fires on a step from
    #: ``quiet_from`` to before ``quiet_until`` (the steps after the one that made the plan, before the next logging step)
    quiet_from: int = 0
    quiet_until: int = 0
    planned: frozenset[int] = frozenset()
    planned_refs: tuple[Any, ...] = ()  # the schedules themselves: alive while planned, so no id is reused

    def is_due(self, schedule: Callable[[int], bool]) -> bool:
        """Whether ``schedule`` fires at the step in progress, or the step is in an anomaly window. Between logging
        steps a schedule of the plan is not called: two comparisons and a set look-up answer it."""
        step = self.step
        if self.quiet_from <= step < self.quiet_until and step > self.anomaly_until and id(schedule) in self.planned:
            return False
        return schedule(step) or (step <= self.anomaly_until and getattr(schedule, "anomaly", True))

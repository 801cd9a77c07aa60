"""``grads_missing``: the optimizer keeps stepping, and no gradient reaches any parameter it holds.

Not a gradient that vanished (``grad_vanishing``: small, still there) nor one wiped before the step (``grads_wiped``:
the backward pass left it, something zeroed it): no backward pass reached these parameters at all. The run looks
calm (no NaN, no spike, the loss merely stops improving, or never starts), which is why it costs days. The usual
causes, told apart by the ``grad/reach`` table the grads probe adds when it happens
(:mod:`trackdiag.capture.graph_reach`):

- the model was replaced after the optimizer was built (``model = copy.deepcopy(model)``, a new instance with
  ``load_state_dict``, a re-wrapped model): the loss's graph does not reach the parameters the optimizer holds;
- ``loss.backward()`` is no longer called (moved under a condition, lost in a refactor): the graph reaches them;
- the loss was made to require grad with no graph behind it (``requires_grad_(True)`` after a ``no_grad`` forward);
- the model's parameters were replaced after the optimizer was built (``layer.weight = nn.Parameter(...)``).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Sequence

from trackdiag.capture.context import Component
from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.rules.base import Rule, phase_start


def _cause(reach: dict[str, float]) -> str:
    """The cause ``grad/reach`` points to, as a clause of the message."""
    if reach.get("replaced") == 1.0:
        return ("the model's parameters were replaced after the optimizer was built (an assignment such as "
                "layer.weight = nn.Parameter(...), a re-initialisation that makes new tensors): the optimizer holds the "
                "old ones, which nothing uses any more")
    if reach.get("leaf") == 1.0:
        return ("the loss given to step() was made to require grad with no graph behind it (.requires_grad_(True) on a "
                "loss computed under torch.no_grad() or inference_mode, or from .detach()ed outputs): its backward "
                "reaches no weight")
    if reach.get("reaches") == 0.0:
        return ("the loss given to step() does not depend on any parameter this optimizer holds: the model that "
                "computes it is not the one the optimizer was built over (a model replaced after the optimizer was "
                "built: copy.deepcopy, a new instance given load_state_dict, a re-wrapped model)")
    if reach.get("reaches") == 1.0:
        return ("the loss given to step() depends on these parameters, yet no backward pass reached them: "
                "loss.backward() is not called (moved under a condition, lost in a refactor) or is called on "
                "another tensor")
    return ("loss.backward() is not called, the model was replaced after the optimizer was built (copy.deepcopy, a "
            "new instance given load_state_dict) or its parameters were (layer.weight = nn.Parameter(...)), or the "
            "loss is cut off from the model (torch.no_grad(), .detach()); the loss given to step() does not tell which "
            "(give it the loss you call backward() on)")


class GradsMissing(Rule):
    """Fires when the pre-clip global gradient norm of a component (its every-step series) is exactly 0 at ``span``
    (10) optimizer steps in a row, either after steps with gradients (at least ``share``, 0.9, of the up to ``before``,
    40, steps before the run had a gradient: a component only some steps train, a head of a task sampled at random, is
    not this) or from the first step while no component of the session has had a gradient yet (one component without
    a gradient from its start while others train is a head waiting for its task). Not when a backward pass reached
    the parameters and left their gradient exactly 0 (``grad/reach``'s ``backward``: a loss weight of 0, a mask that
    keeps nothing: the loss does not move with the weights, ``not_learning`` says so), nor for a component none of
    whose parameters requires a gradient (a model frozen on purpose: the set-up checks say so). ``unambiguous`` and
    ``persistent``; ``step`` is the first step without a gradient, ``where`` the component. Once per run of such
    steps."""

    kind = "grads_missing"
    hint = ("Build the optimizer after the last change to the model, over the parameters of the model that computes "
            "the loss (after copy.deepcopy or re-creating a model: a new optimizer, then diag.attach(optimizer)); "
            "call loss.backward() before every optimizer.step(); compute the training loss outside torch.no_grad() "
            "and without .detach()/.item().")

    def __init__(self, *, span: int = 10, before: int = 40, share: float = 0.9, **kw: Any) -> None:
        super().__init__(**kw)
        self.span, self.before, self.share = max(2, span), max(1, before), share
        self._had: dict[str, deque[bool]] = {}  # per component: had a gradient, at the steps before the run of zeros
        self._run: dict[str, tuple[int, int]] = {}  # per component: (first step, length) of the run of zeros going on
        self._fired: dict[str, int] = {}  # per component: the first step of the run already raised
        self._trained: set[str] = set()  # the components that have had a gradient at some step

    def check(self, record: Record, history: Sequence[Record], components: Sequence[Component]) -> list[Alert]:
        judged = [comp for comp in components if self._feed(record, comp)]  # every component first: see _judge
        return [a for comp in judged for a in self._judge(record, comp)]

    def _feed(self, record: Record, comp: Component) -> bool:
        """The window's every-step norms into the component's state; whether it has a series here."""
        points = record.series.get(comp.key("grad/global_norm"))
        if not points:
            return False
        name = comp.name
        ps = phase_start(record)
        if ps >= 0:  # a new phase (an optimizer's first step, parameters joining): judged from there
            self._had[name] = deque(maxlen=self.before)
            self._run[name] = (-1, 0)
        had = self._had.setdefault(name, deque(maxlen=self.before))
        start, run = self._run.get(name, (-1, 0))
        for step, v in points:
            if step < ps:
                continue
            if v == 0.0:
                start, run = (start if run else step), run + 1
                continue
            had.extend([False] * min(run, self.before))  # a short run of zeros: steps without a gradient
            had.append(True)
            self._trained.add(name)
            start, run = -1, 0
        self._run[name] = (start, run)
        return True

    def _judge(self, record: Record, comp: Component) -> list[Alert]:
        name = comp.name
        start, run = self._run[name]
        had = self._had[name]
        if run < self.span or self._fired.get(name) == start:
            return []
        after = sum(had)
        if had and (len(had) < self.span or after < self.share * len(had)):
            return []  # a component only some steps train (a task's head), or too little seen to tell
        if not had and self._trained:
            return []  # from its first step, while another component trains: a head of a task not sampled yet
        if not any(p.requires_grad for p in comp.index.params):
            return []  # frozen on purpose: nothing to reach
        reach = record.tables.get(comp.key("grad/reach"), {})
        if reach.get("backward") == 1.0:
            return []  # a backward pass reached them and left exactly 0: a loss weight of 0 (not_learning's), not this
        self._fired[name] = start
        what = f"component {name!r}" if name else "the model"
        since = (f"since step {start} ({run} optimizer steps; {after} of the {len(had)} steps before had one)"
                 if had else f"since its first step ({run} optimizer steps)")
        msg = (f"the optimizer of {what} steps, but no gradient reaches any parameter it holds {since}: the pre-clip "
               f"gradient norm is exactly 0 at every step, so the weights do not train. The likely cause: "
               f"{_cause(reach)}.")
        return [self.make(start, msg, 0.0, 0.0, name or "(all layers)", ["unambiguous", "persistent"])]

    def state_dict(self) -> dict[str, Any]:
        return {"had": {k: list(v) for k, v in self._had.items()}, "run": dict(self._run), "fired": dict(self._fired),
                "trained": sorted(self._trained)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._had = {k: deque(v, maxlen=self.before) for k, v in state.get("had", {}).items()}
        self._run = {k: tuple(v) for k, v in state.get("run", {}).items()}  # type: ignore[misc]
        self._fired = dict(state.get("fired", {}))
        self._trained = set(state.get("trained", []))

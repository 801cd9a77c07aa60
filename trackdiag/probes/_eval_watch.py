"""What the probes that watch evaluations share (``eval_mode``, ``eval_inputs``): from the first ``log_eval`` on, each
model's own calls through its call slot (:mod:`trackdiag.capture.forward_watch`); never the reason for a logging step,
nothing to do between them (their work happens in the models' calls and at ``log_eval``)."""
from __future__ import annotations

from typing import Any, Callable

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.forward_watch import FORWARD, PreFn, may_watch
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never


class EvalWatchProbe(Probe):
    """A probe that watches the models' calls once evaluations begin (see module docstring)."""

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._ctx: ProbeContext | None = None
        self._stops: list[Any] = []

    def bind(self, default_every: int) -> None:
        self.schedule = Never()

    def quiet(self, ctx: ProbeContext) -> bool:
        return True

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    @property
    def watching(self) -> bool:
        return bool(self._stops)

    def watch_models(self, ctx: ProbeContext, pre_for: Callable[[Component], PreFn]) -> list[Component]:
        """Watch each model's calls with ``pre_for(component)`` (its root: the wrapper the user calls, if any); none
        while a compiled model forbids it (a recompile). Returns the components watched."""
        watched: list[Component] = []
        if may_watch(ctx.compiled):
            for comp in ctx.components:
                if comp.model is not None:
                    root = comp.outer if comp.outer is not None else comp.model
                    self._stops.append(FORWARD.watch(root, pre=pre_for(comp), root=True))
                    watched.append(comp)
        return watched

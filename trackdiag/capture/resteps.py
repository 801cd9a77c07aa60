"""An optimizer that steps again on the gradients of its last step (``optimizer.step()`` twice per iteration): what
``optimizer_restepped`` judges (published by the ``lr`` probe as ``diag/[<c>/]opt/restepped``).

At each outermost ``step()`` without a closure, the session hands the optimizer here. Its gradients are taken as
those of its last step when no backward pass reached the component since then (the gradient tap's count, where the
component is tapped) and each of two of its parameters' gradients (the first and the last that have one) is the very
tensor of that step, at the same version: nothing wrote to it since (``zero_grad`` and a backward pass accumulating
into it each move the version; ``set_to_none`` and gradients assigned by hand make new tensors). The tensors are held by
weak reference: a freed gradient never matches. Cost: a few attribute reads per optimizer step (the two parameters
are found once, again only when one of them has no gradient).
"""
from __future__ import annotations

import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: optimizer steps judged together: ``optimizer_restepped`` looks at how many of the last ``SPAN`` were repeats
SPAN = 10


def _with_grads(opt: Any) -> tuple[Any, Any] | None:
    """The first and the last parameter of ``opt`` that hold a gradient (the same one twice when only one does)."""
    params = [p for g in getattr(opt, "param_groups", ()) for p in g.get("params", ())]
    first = next((p for p in params if getattr(p, "grad", None) is not None), None)
    if first is None:
        return None
    return first, next((p for p in reversed(params) if getattr(p, "grad", None) is not None), first)


@dataclass
class Resteps:
    """Per component: of its optimizers' last ``SPAN`` steps, which found the gradients of the same optimizer's step
    before (see the module docstring). :meth:`observe` runs at every optimizer step: one Python frame, no
    comprehension (each would be another)."""

    recent: deque = field(default_factory=lambda: deque(maxlen=SPAN))  # (step, repeat) of the latest optimizer steps
    hits: int = 0  # repeats in ``recent``
    total: int = 0  # repeats so far
    kind: str = ""  # the optimizer class of the latest repeat
    since: int = -1  # the session step of the first repeat of the latest run of them
    failed: str = ""  # why the session stopped observing (an exception): the check is off, said in the summary
    #: id(opt) -> (passes, weak refs to the two gradients and their versions) at its last step
    _last: dict[int, tuple[int, tuple[Any, int, Any, int]]] = field(default_factory=dict)
    _params: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id(opt) -> weak refs to the parameters read

    def observe(self, opt: Any, step: int, passes: int) -> None:
        """``opt`` steps now at session step ``step``; ``passes``: backward passes the tap counted so far (-1: none)."""
        key = id(opt)
        cached = self._params.get(key)
        first = last = None
        if cached is not None:
            first, last = cached[0](), cached[1]()
        if first is None or last is None or first.grad is None or last.grad is None:  # a scan, rarely
            found = _with_grads(opt)
            if found is None:
                self._last.pop(key, None)
                return
            first, last = found
            self._params[key] = (weakref.ref(first), weakref.ref(last))
            if len(self._params) > 16:
                del self._params[next(iter(self._params))]
        g1, g2 = first.grad, last.grad
        held = (weakref.ref(g1), g1._version, weakref.ref(g2), g2._version)
        before = self._last.pop(key, None)
        self._last[key] = (passes, held)  # the newest last: an optimizer built anew each step leaves old ids behind
        if len(self._last) > 16:
            del self._last[next(iter(self._last))]
        repeat = False
        if before is not None and (passes < 0 or passes == before[0]):
            was = before[1]
            repeat = was[0]() is g1 and was[1] == held[1] and was[2]() is g2 and was[3] == held[3]
        if len(self.recent) == SPAN:
            self.hits -= self.recent[0][1]
        if repeat:
            if not self.hits:  # the first repeat in ``SPAN`` steps: a run of them begins
                self.since = step
            self.total += 1
            self.kind = type(opt).__name__
        self.recent.append((step, repeat))
        self.hits += repeat

    def repeats(self) -> tuple[int, int]:
        """(repeats among the last ``SPAN`` optimizer steps, the session step at which their run began: the first
        repeat with none in the ``SPAN`` steps before it; -1 without)."""
        return self.hits, (self.since if self.hits else -1)

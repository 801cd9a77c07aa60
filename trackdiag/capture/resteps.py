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


def _with_grads(opt: Any) -> tuple[Any, ...]:
    """The first and the last parameter of ``opt`` that hold a gradient (one when only one does)."""
    params = [p for g in getattr(opt, "param_groups", ()) for p in g.get("params", ())]
    first = next((p for p in params if getattr(p, "grad", None) is not None), None)
    if first is None:
        return ()
    last = next((p for p in reversed(params) if getattr(p, "grad", None) is not None), first)
    return (first,) if last is first else (first, last)


@dataclass
class Resteps:
    """Per component: of its optimizers' last ``SPAN`` steps, which found the gradients of the same optimizer's step
    before (see the module docstring)."""

    recent: deque = field(default_factory=lambda: deque(maxlen=SPAN))  # (step, repeat) of the latest optimizer steps
    total: int = 0  # repeats so far
    kind: str = ""  # the optimizer class of the latest repeat
    since: int = -1  # the session step of the first repeat of the latest run of them
    failed: str = ""  # why the session stopped observing (an exception): the check is off, said in the summary
    _last: dict[int, tuple[int, tuple[tuple[Any, int], ...]]] = field(default_factory=dict)  # id(opt) -> (passes, grads)
    _params: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # id(opt) -> weak refs to the parameters read

    def observe(self, opt: Any, step: int, passes: int) -> None:
        """``opt`` steps now at session step ``step``; ``passes``: backward passes the tap counted so far (-1: none)."""
        cached = self._params.get(id(opt))
        params = [r() for r in cached] if cached else []
        if not params or any(p is None or p.grad is None for p in params):  # a scan of the param groups, rarely
            params = list(_with_grads(opt))
            self._params[id(opt)] = tuple(weakref.ref(p) for p in params)
        held = tuple((weakref.ref(g), g._version) for p in params if (g := p.grad) is not None)
        before = self._last.pop(id(opt), None)
        self._last[id(opt)] = (passes, held)  # the newest last: an optimizer built anew each step leaves old ids behind
        if len(self._last) > 16:
            del self._last[next(iter(self._last))]
        if len(self._params) > 16:
            del self._params[next(iter(self._params))]
        if not held:
            return
        repeat = (before is not None and (passes < 0 or passes == before[0]) and len(before[1]) == len(held)
                  and all(ref() is ref_now() and version == v_now
                          for (ref, version), (ref_now, v_now) in zip(before[1], held)))
        if repeat and not any(r for _, r in self.recent):  # the first repeat in ``SPAN`` steps: a run of them begins
            self.since = step
        self.recent.append((step, repeat))
        if repeat:
            self.total += 1
            self.kind = type(opt).__name__

    def repeats(self) -> tuple[int, int]:
        """(repeats among the last ``SPAN`` optimizer steps, the session step at which their run began: the first
        repeat with none in the ``SPAN`` steps before it; -1 without)."""
        hits = sum(r for _, r in self.recent)
        return hits, (self.since if hits else -1)

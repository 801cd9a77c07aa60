"""The optimizer that really steps, behind any wrapper, and process-wide optimizer step hooks.

Wrappers seen in users' code: accelerate's ``AcceleratedOptimizer`` (``.optimizer``; a
``torch.optim.Optimizer`` subclass that never ran ``Optimizer.__init__``, so it has no hook
dicts), Lightning's ``LightningOptimizer`` (``._optimizer``), ``ZeroRedundancyOptimizer``
(a real optimizer that steps an inner one, ``.optim``), Lookahead/SAM-style wrappers
(``.base_optimizer`` / ``.optimizer``), and users' own subclasses that skip ``__init__``.

trackdiag never registers per-instance hooks: one pair of global hooks
(``torch.optim.optimizer.register_optimizer_step_pre_hook`` / ``..._post_hook``) is installed
once per process and every live session is told about every optimizer step. That finds
optimizers created after the session (a trainer that builds its own inside ``run()``), works for
wrappers (the inner optimizer's ``step`` runs the hooks), and leaves nothing on the user's objects.
Cost: one Python call per optimizer step per live session; nothing else.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Callable, Protocol

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from trackdiag.core.errors import brief
from trackdiag.util.pausing import Pausable

log = logging.getLogger("trackdiag")

#: attributes under which wrappers keep the optimizer they wrap, tried in order
WRAPPED_ATTRS = ("optimizer", "_optimizer", "optim", "base_optimizer", "inner_optimizer", "opt")


def hookable(opt: Any) -> bool:
    """True for an optimizer whose ``step`` runs torch's step hooks (it ran ``Optimizer.__init__``)."""
    return isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "_optimizer_step_pre_hooks")


def param_groups(opt: Any) -> list[dict[str, Any]]:
    """The ``param_groups`` of ``opt`` (or of what it wraps); ``[]`` when there are none. ``opt``'s
    own are tried before the wrapper chain is walked (a plain optimizer: one attribute read)."""
    groups = _groups_of(opt)
    if groups is not None:
        return groups
    for cand in chain_of(opt)[1:]:
        groups = _groups_of(cand)
        if groups is not None:
            return groups
    return []


def _groups_of(obj: Any) -> list[dict[str, Any]] | None:
    groups = getattr(obj, "param_groups", None)
    if isinstance(groups, list):
        for g in groups:
            if not isinstance(g, dict) or "params" not in g:
                return None
        return groups
    return None


def chain_of(opt: Any, depth: int = 6) -> list[Any]:
    """``opt`` and the objects it wraps, outermost first (cycles and depth bounded)."""
    out: list[Any] = []
    cur = opt
    while cur is not None and len(out) < depth and all(cur is not o for o in out):
        out.append(cur)
        cur = _wrapped(cur)
    return out


def _wrapped(obj: Any) -> Any | None:
    """The optimizer ``obj`` wraps, or None."""
    for attr in WRAPPED_ATTRS:
        try:
            inner = getattr(obj, attr, None)
        except Exception:  # noqa: BLE001 - a property that raises is no wrapped optimizer
            continue
        if inner is not None and inner is not obj and hasattr(inner, "step") and hasattr(inner, "param_groups"):
            return inner
    return None


def real_optimizer(opt: Any) -> Any | None:
    """The innermost hookable optimizer behind ``opt`` (``opt`` itself when it is one and wraps
    nothing hookable), or ``None`` when nothing in the chain runs torch's step hooks."""
    hooked = [o for o in chain_of(opt) if hookable(o)]
    return hooked[-1] if hooked else None


def scaler_of(opt: Any) -> Any | None:
    """A ``GradScaler`` a wrapper carries (accelerate's ``AcceleratedOptimizer.scaler``), or None."""
    for cand in chain_of(opt):
        scaler = getattr(cand, "scaler", None)
        if scaler is not None and hasattr(scaler, "get_scale") and hasattr(scaler, "unscale_"):
            return scaler
    return None


def gradient_states(opt: Any) -> list[Any]:
    """The ``gradient_state`` objects (accelerate's) along ``opt``'s wrapper chain; ``[]`` for a plain
    optimizer. Its ``sync_gradients`` is False on a micro-batch that is not an optimizer step (under
    ``accelerator.accumulate``). A session caches this per given optimizer, so a step reads only that."""
    return [s for s in (getattr(cand, "gradient_state", None) for cand in chain_of(opt)) if s is not None]


def accelerate_accumulating(model: Any) -> bool:
    """True inside ``accelerator.accumulate(model)`` off the sync step, for a model that
    ``accelerator.prepare`` saw (whichever optimizer object the session was given)."""
    if model is None:
        return False
    # accelerate sets the flag in the instance's __dict__; a module's getattr miss costs ~2 us
    flag = getattr(model, "__dict__", {}).get("_is_accelerate_prepared")
    if not (flag if flag is not None else getattr(type(model), "_is_accelerate_prepared", False)):
        return False
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is None:
        return False
    try:
        return state_mod.GradientState().sync_gradients is False
    except Exception:  # noqa: BLE001 - another accelerate version: no opinion
        return False


def top_lr(opt: Any) -> float | None:
    """The largest learning rate among ``opt``'s parameter groups (None: no numeric ``lr``). Host work."""
    try:
        return max(float(g["lr"]) for g in opt.param_groups)
    except (AttributeError, KeyError, TypeError, ValueError, RuntimeError):  # a wrapper without groups, a tensor LR on a device...
        return None


def closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The closure passed to ``step`` (the hooks see ``args = (optimizer, closure?)``), or None."""
    if len(args) > 1 and callable(args[1]):
        return args[1]
    closure = kwargs.get("closure")
    return closure if callable(closure) else None


class StepListener(Protocol):
    """What a session implements to hear about optimizer steps."""

    def optimizer_pre_step(self, opt: torch.optim.Optimizer, closure: Any) -> None: ...

    def optimizer_post_step(self, opt: torch.optim.Optimizer, closure: Any) -> None: ...


class _Dispatch(Pausable):
    """The process's one pair of global optimizer hooks, fanned out to live listeners; ``paused()``: no
    listener hears an optimizer step inside (trackdiag's own: the pre-flight's copies)."""

    def __init__(self) -> None:
        super().__init__()
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._live: tuple[weakref.ref[Any], ...] = ()  # the listeners as plain references (a WeakSet iterates in Python)
        self._handles: list[Any] = []
        # reentrant: a listener's finalizer (``_collected``) may run inside a garbage collection that an
        # allocation under this lock set off
        self._lock = threading.RLock()

    def add(self, listener: StepListener) -> None:
        with self._lock:
            self._listeners.add(listener)
            self._live = tuple(weakref.ref(x) for x in self._listeners)
            # a session dropped without close() (never opened) must not leave torch's global hooks behind
            weakref.finalize(listener, self._collected)
            if not self._handles:
                self._handles = [register_optimizer_step_pre_hook(self._pre),
                                 register_optimizer_step_post_hook(self._post)]

    def discard(self, listener: StepListener) -> None:
        with self._lock:
            self._listeners.discard(listener)
            self._live = tuple(weakref.ref(x) for x in self._listeners)
            self._release()

    def _collected(self) -> None:
        with self._lock:
            self._live = tuple(weakref.ref(x) for x in self._listeners)
            self._release()

    def _release(self) -> None:
        """Remove the global hooks once no listener is left (the lock is held)."""
        if not len(self._listeners) and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _fan(self, method: str, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._paused or not self._live:
            return
        closure = args[1] if len(args) > 1 and callable(args[1]) else (closure_of(args, kwargs) if kwargs else None)
        for ref in self._live:
            listener = ref()
            if listener is None:
                continue
            fn: Callable[..., None] = getattr(listener, method)
            try:
                fn(opt, closure)
            except Exception as exc:  # noqa: BLE001 - never raise into the user's optimizer.step()
                log.warning("trackdiag: optimizer hook failed (%s); this step is not measured", brief(exc))

    def _pre(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fan("optimizer_pre_step", opt, args, kwargs)
        return None

    def _post(self, opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._fan("optimizer_post_step", opt, args, kwargs)


DISPATCH = _Dispatch()

"""Forward calls of a module, seen without a hook: the module's own call slot.

``Module.__call__`` runs ``self._compiled_call_impl(*args, **kwargs)`` instead of ``self._call_impl``
when that instance attribute is set (``Module.compile()`` sets it to the compiled call). torch's own
``Module.__getstate__`` drops it, so ``torch.save(model)``, ``pickle``, ``copy.copy`` and
``copy.deepcopy`` never carry it; ``state_dict`` never sees it, ``torch.jit.script`` ignores it, and a
model compiled later traces it as a plain function (``torch.compiler.is_compiling()`` is
constant-folded: no graph break). Classes that copy their ``__dict__`` themselves are covered too:
``nn.GRU``/``nn.LSTM`` (``RNNBase.__getstate__`` keeps every attribute) get an instance ``__getstate__``
that drops the slot (removed with it), and the slot's call object deep-copies and pickles as None
(parametrized modules' own ``__deepcopy__`` copies ``__dict__``): a copy always runs its own weights.

trackdiag sets it on the roots whose forward calls a probe watches (the NaN replay's captured calls,
the integrations' step loss, CUDA memory phases) and, under ``extreme``'s per-module output flags, on
every module of the session's models, to a call that runs the watchers around the module's own
``_call_impl``: every other module of the process keeps PyTorch's fast call path, which a global
forward hook would take from all of them (~1.5-2 us per module call on a CPU; a GRU seq2seq step
makes ~65 module calls of which 16 are the roots').

Not used (:func:`usable` is False, and :mod:`trackdiag.capture.forward_watch` falls back to its global
hooks) for a module compiled with ``module.compile()`` (the slot is taken) and on a torch without
the slot (< 2.2). Removed when the last watcher stops, unless something replaced it meanwhile (a
``module.compile()`` after the session began: then the module is compiled and not watched).
``DataParallel`` replicas copy ``__dict__`` (the slot too) and run in worker threads: a call from
another thread than the one that installed the slot checks which module it belongs to (one frame
look-up) and runs that module's own call, unwatched.

Cost per call of a watched module: one Python call (the watchers are bound into it), plus the watchers.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.core.errors import brief
from trackdiag.util.pausing import Pausable

try:  # the functorch transform level: None outside torch.func's vmap/grad/jacrev
    from torch._C._functorch import maybe_current_level as transform_level
except ImportError:  # pragma: no cover - an older torch
    def transform_level() -> None:
        return None

SLOT = "_compiled_call_impl"
_is_compiling = torch.compiler.is_compiling
PreFn = Callable[[nn.Module, tuple[Any, ...]], None]
PostFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]
log = logging.getLogger("trackdiag")


def _slot_is_private() -> bool:
    """Whether this torch has the slot and drops it from a module's pickled/copied state."""
    if getattr(nn.Module, SLOT, 0) is not None:
        return False
    probe = nn.Module()
    object.__setattr__(probe, SLOT, len)
    try:
        return SLOT not in probe.__getstate__()
    except Exception:  # noqa: BLE001 - an unexpected torch: use the global hooks
        return False


_PRIVATE = _slot_is_private()


def usable(module: Any) -> bool:
    """Whether ``module``'s calls can be watched through its call slot (eager, slot free)."""
    return _PRIVATE and isinstance(module, nn.Module) and module.__dict__.get(SLOT) is None


class _Slot:
    """A watched module's call (see :func:`install`): a ``deepcopy`` of it is None, so a module class with
    its own ``__deepcopy__`` that copies ``__dict__`` (parametrized modules: ``weight_norm``,
    ``spectral_norm``) gives a copy that runs its own call, not this module's (its weights untouched by the
    copy's training: the pre-flight's copies saw no gradient); it pickles as None too."""

    __slots__ = ("module", "impl", "pre", "post", "gate", "owner")
    trackdiag = True  # see :func:`compiled`

    def __init__(self, module: nn.Module, pre: tuple[PreFn, ...], post: tuple[PostFn, ...], gate: Pausable) -> None:
        self.module, self.impl, self.pre, self.post, self.gate = module, module._call_impl, pre, post, gate
        self.owner = threading.get_ident()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self.impl
        if _is_compiling():  # traced by Dynamo: the plain call, nothing of trackdiag (first: no guard on the gate)
            return impl(*args, **kwargs)
        module = self.module
        if threading.get_ident() != self.owner:  # a DataParallel replica shares this slot: run its own call
            caller = sys._getframe(1).f_locals.get("self")
            if isinstance(caller, nn.Module) and caller is not module:
                return caller._call_impl(*args, **kwargs)
        if self.gate._paused or transform_level() is not None:
            return impl(*args, **kwargs)
        around = None
        for fn in self.pre:
            try:
                cm = fn(module, args)
                if cm is not None:  # a context to run this one call in (the eval_mode probe's dropout spy)
                    cm.__enter__()
                    around = [cm] if around is None else [*around, cm]
            except Exception as exc:  # noqa: BLE001 - never raise into the user's forward
                log.warning("trackdiag: forward watcher failed (%s)", brief(exc))
        if around is None:
            output = impl(*args, **kwargs)
        else:
            try:
                output = impl(*args, **kwargs)
            finally:
                for cm in reversed(around):
                    cm.__exit__(None, None, None)
        for fn in self.post:
            try:
                fn(module, args, kwargs, output)
            except Exception as exc:  # noqa: BLE001 - never raise into the user's forward
                log.warning("trackdiag: forward watcher failed (%s)", brief(exc))
        return output

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return type(None), ()  # unpickled as None: the module's own call


def install(module: nn.Module, pre: tuple[PreFn, ...], post: tuple[PostFn, ...], gate: Pausable,
            current: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Route ``module``'s calls through ``pre(module, args)`` watchers (one that returns a context manager has this
    call run inside it: entered after the watchers, left however the call ends), the module's own
    ``_call_impl``, then ``post(module, args, kwargs, output)`` watchers, unless ``gate`` is paused
    (trackdiag's own forwards) or a ``torch.func`` transform is running (its tensors must not escape it); returns
    the installed call, for :func:`uninstall`. ``current``: the call installed before (the watchers
    changed), replaced only if the slot still holds it.

    The call is rebuilt whenever the watchers change, with them bound in: a call pays one Python
    frame and the watchers. (A dispatcher that looked them up per call, plus the NaN replay's capture,
    cost ~0.35 ms of a 16-call seq2seq step, ~7 % of it; now ~0.2 ms: benchmarks/overhead.py --workloads short.)"""
    if current is not None and module.__dict__.get(SLOT) is not current:
        return current
    call = _Slot(module, pre, post, gate)
    object.__setattr__(module, SLOT, call)
    if GETSTATE not in module.__dict__ and _keeps_slot(module):
        object.__setattr__(module, GETSTATE, _StateWithoutSlot(module))
    return call


GETSTATE = "__getstate__"


def _keeps_slot(module: nn.Module) -> bool:
    """Whether ``module``'s class puts the call slot in its pickled state (``RNNBase.__getstate__`` copies
    ``__dict__``); a class whose ``__getstate__`` refuses to pickle (parametrized modules) needs nothing."""
    getstate = type(module).__getstate__
    if getstate is nn.Module.__getstate__:
        return False
    try:
        return SLOT in getstate(module)
    except Exception:  # noqa: BLE001 - the class refuses pickling: nothing of ours can travel
        return False


class _StateWithoutSlot:
    """An instance ``__getstate__`` (``pickle``, ``copy`` and ``deepcopy`` look it up on the instance
    first) for a module whose class keeps every attribute in its state (``RNNBase.__getstate__`` copies
    ``__dict__``): the class's state without trackdiag's call slot and without itself."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = weakref.ref(module)

    def __call__(self) -> dict[str, Any]:
        module = self.module()
        state = type(module).__getstate__(module) if module is not None else {}
        state.pop(SLOT, None)
        state.pop(GETSTATE, None)
        return state


def compiled(module: Any) -> bool:
    """Whether ``module``'s call slot holds a compiled call (``module.compile()``), not trackdiag's own."""
    impl = getattr(module, SLOT, None)
    return impl is not None and not getattr(impl, "trackdiag", False)


def uninstall(module: nn.Module, call: Callable[..., Any]) -> None:
    """Give ``module`` its own call back, unless the slot holds something else by now."""
    if module.__dict__.get(SLOT) is call:
        del module.__dict__[SLOT]
        if isinstance(module.__dict__.get(GETSTATE), _StateWithoutSlot):
            del module.__dict__[GETSTATE]

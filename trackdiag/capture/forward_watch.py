"""Forward calls of the sessions' modules, seen without a hook on the modules themselves.

A hook registered on a module lives in the module's ``__dict__``: ``torch.save(model)`` pickles it
(so the checkpoint needs trackdiag to load, and ``weights_only=True`` refuses it) and
``torch.compile`` traces it. trackdiag watches instead:

* a session's *root* modules (``watch(..., root=True)``: the NaN replay's captured calls, the
  integrations' step loss, CUDA memory phases; and every module of the models under ``extreme``'s
  per-module output flags) through the module's own call slot
  (:mod:`trackdiag.capture.root_call`: an attribute torch drops from pickles and copies); every other module
  keeps PyTorch's fast call path;
* any other module (activations on their due steps), a root whose slot is taken (``module.compile()``)
  and ``watch_all`` through one *global* forward pre-hook and/or one global forward hook (torch's
  ``register_module_forward_pre_hook`` / ``register_module_forward_hook``), installed only while
  such a watcher exists (the pre-hook only while a pre watcher does). Each returns at once for
  modules nobody watches (one dict lookup) and does nothing while Dynamo traces
  (``torch.compiler.is_compiling()`` is constant-folded there, so a model compiled after the hooks
  were installed has no graph break and no extra guard failure).

``paused()``: nothing is called inside (trackdiag's own forwards: replays, pre-flight, landscapes);
nor inside a ``torch.func`` transform (``vmap(grad(...))`` per-sample gradients, as DP-SGD computes
them): the tensors there are the transform's and must not escape it.
``watch_all(fn)`` calls ``fn(module, args, output)`` after the forward of *every* module of the
process (through the global hook: no probe uses it on the training path).

Cost: a watched root, one Python call per call (its watchers are bound into it); while the global hooks are
installed, PyTorch takes its slower ``_call_impl`` path for every module call in the process (~1.5-2
us per module call on CPU, hook included), plus what a ``watch_all`` function does; nothing when no
session watches.
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.capture import root_call
from trackdiag.core.errors import brief
from trackdiag.util.pausing import Pausable

log = logging.getLogger("trackdiag")

_transform_level = root_call.transform_level

PreFn = Callable[[nn.Module, tuple[Any, ...]], None]
PostFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]
AllFn = Callable[[nn.Module, tuple[Any, ...], Any], None]


class _ForwardWatch(Pausable):
    """See module docstring; ``paused()``: no watcher is called inside (trackdiag's own forwards)."""

    def __init__(self) -> None:
        super().__init__()
        self._pre: dict[int, list[PreFn]] = {}  # global hooks' watchers, by id(module)
        self._post: dict[int, list[PostFn]] = {}
        self._rpre: dict[int, list[PreFn]] = {}  # roots watched through their call slot
        self._rpost: dict[int, list[PostFn]] = {}
        self._roots: dict[int, tuple[nn.Module, Callable[..., Any]]] = {}  # id -> (root, its installed call)
        self._every: list[AllFn] = []
        self._handles: list[Any] = []  # the global hooks: [post] or [post, pre]
        self._pre_handle: Any = None
        self._lock = threading.Lock()

    def watch(self, module: nn.Module, pre: PreFn | None = None, post: PostFn | None = None,
              root: bool = False) -> Callable[[], None]:
        """Call ``pre(module, args)`` before and ``post(module, args, kwargs, output)`` after every
        forward of ``module`` (eager mode only). ``root``: a model the user calls (few calls per
        step), watched through its call slot when it is free (see module docstring); its watchers
        then see the arguments as passed (before the module's own pre-hooks) and the output its
        hooks return. Returns the function that stops it."""
        with self._lock:
            key = id(module)
            direct = root and (key in self._roots or root_call.usable(module))
            pres, posts = (self._rpre, self._rpost) if direct else (self._pre, self._post)
            if pre is not None:
                pres.setdefault(key, []).append(pre)
            if post is not None:
                posts.setdefault(key, []).append(post)
            if direct:
                self._route(module)
            else:
                self._install()

        def stop() -> None:
            with self._lock:
                for table, fn in ((pres, pre), (posts, post)):
                    fns = table.get(key)
                    if fns is not None and fn in fns:
                        fns.remove(fn)
                        if not fns:
                            del table[key]
                if direct and key in self._roots:
                    self._route(self._roots[key][0])
                self._uninstall()
        return stop

    def _route(self, module: nn.Module) -> None:
        """(Re)install ``module``'s call slot with its current root watchers bound in; give the slot
        back when none is left."""
        key = id(module)
        pre, post = tuple(self._rpre.get(key, ())), tuple(self._rpost.get(key, ()))
        _, current = self._roots.pop(key, (module, None))
        if not pre and not post:
            if current is not None:
                root_call.uninstall(module, current)
            return
        self._roots[key] = (module, root_call.install(module, pre, post, self, current))

    def watch_all(self, fn: AllFn) -> Callable[[], None]:
        """Call ``fn(module, args, output)`` after every eager forward of every module. Returns the stopper."""
        with self._lock:
            self._every.append(fn)
            self._install()

        def stop() -> None:
            with self._lock:
                if fn in self._every:
                    self._every.remove(fn)
                self._uninstall()
        return stop

    def _install(self) -> None:
        """The global hooks the watchers need: the post hook for any, the pre hook for pre watchers."""
        if not self._handles:
            # torch warns that global hooks fire once more for a torch.compile(module) wrapper: ours
            # only act on the watched module itself, so that extra call is a no-op
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self._handles = [nn.modules.module.register_module_forward_hook(self._on_post, with_kwargs=True)]
        if self._pre and self._pre_handle is None:
            self._pre_handle = nn.modules.module.register_module_forward_pre_hook(self._on_pre)
            self._handles.append(self._pre_handle)

    def _uninstall(self) -> None:
        if not self._pre and self._pre_handle is not None:  # no pre watcher left: one Python call less per module call
            self._pre_handle.remove()
            self._handles.remove(self._pre_handle)
            self._pre_handle = None
        if not self._pre and not self._post and not self._every and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _on_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._paused or torch.compiler.is_compiling() or _transform_level() is not None:
            return None
        fns = self._pre.get(id(module))
        if fns:
            for fn in list(fns):
                _safe(fn, module, args)
        return None

    def _on_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._paused or torch.compiler.is_compiling() or _transform_level() is not None:
            return None
        for every in self._every:
            try:
                every(module, args, output)
            except Exception as exc:  # noqa: BLE001 - never raise into the user's forward
                log.debug("trackdiag: output watcher failed (%s: %s)", type(exc).__name__, exc)
        fns = self._post.get(id(module))
        if fns:
            for fn in list(fns):
                _safe(fn, module, args, kwargs, output)
        return None


def _safe(fn: Callable[..., None], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - never raise into the user's forward
        log.warning("trackdiag: forward watcher failed (%s)", brief(exc))


FORWARD = _ForwardWatch()


def compiled_before() -> bool:
    """Has Dynamo compiled anything in this process yet? (Installing a global forward hook after
    that would invalidate those graphs' guards once.)"""
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001
        return False
    return bool(counters["stats"]["unique_graphs"])


def may_watch(compiled: bool) -> bool:
    """Whether a probe may start watching a session's forwards now: always for eager models; with a
    compiled one only before Dynamo has compiled anything (a watcher after that costs a recompile)."""
    return not compiled or not compiled_before()


def compiled_parts(model: Any) -> list[str]:
    """Names of the compiled parts of ``model`` (``torch.compile(m)`` wrappers, ``m.compile()``),
    ``""`` for the model itself; ``[]`` for an eager model. Host work only."""
    if model is None:
        return []
    found = []
    mods = model.named_modules() if isinstance(model, nn.Module) else []
    if getattr(model, "_orig_mod", None) is not None or root_call.compiled(model):
        found.append("")
    for name, m in mods:
        if name and (root_call.compiled(m) or type(m).__name__ == "OptimizedModule"):
            found.append(name)
    return found

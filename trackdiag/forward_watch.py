"""Forward calls of the sessions' root modules, seen without a hook on the modules themselves.

A hook registered on a module lives in the module's ``__dict__``: ``torch.save(model)`` pickles it
(so the checkpoint needs trackdiag to load, and ``weights_only=True`` refuses it) and
``torch.compile`` traces it. trackdiag instead installs, only while some session wants forward
calls, one *global* forward pre-hook and one global forward hook (torch's
``register_module_forward_pre_hook`` / ``register_module_forward_hook``): nothing is stored on the
user's modules. Each returns at once for modules that are not a watched root (one dict lookup) and
does nothing while Dynamo traces (``torch.compiler.is_compiling()`` is constant-folded there, so a
model compiled after the hooks were installed has no graph break and no extra guard failure).

``paused()``: nothing is called inside (trackdiag's own forwards: replays, pre-flight, landscapes).
``watch_all(fn)`` calls ``fn(module, args, output)`` after the forward of *every* module (the flight
recorder's per-module output flags, :mod:`trackdiag.output_flags`).

Cost while installed: PyTorch takes its slower ``_call_impl`` path for every module call in the
process (~1 us per module call on CPU), plus what a ``watch_all`` function does; nothing when no
session watches.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trackdiag.errors import brief

log = logging.getLogger("trackdiag")

PreFn = Callable[[nn.Module, tuple[Any, ...]], None]
PostFn = Callable[[nn.Module, tuple[Any, ...], dict[str, Any], Any], None]
AllFn = Callable[[nn.Module, tuple[Any, ...], Any], None]


class _ForwardWatch:
    def __init__(self) -> None:
        self._pre: dict[int, list[PreFn]] = {}
        self._post: dict[int, list[PostFn]] = {}
        self._every: list[AllFn] = []
        self._handles: list[Any] = []
        self._lock = threading.Lock()
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No watcher is called inside (trackdiag's own forwards)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def watch(self, module: nn.Module, pre: PreFn | None = None, post: PostFn | None = None) -> Callable[[], None]:
        """Call ``pre(module, args)`` before and ``post(module, args, kwargs, output)`` after every
        forward of ``module`` (eager mode only). Returns the function that stops it."""
        with self._lock:
            key = id(module)
            if pre is not None:
                self._pre.setdefault(key, []).append(pre)
            if post is not None:
                self._post.setdefault(key, []).append(post)
            self._install()

        def stop() -> None:
            with self._lock:
                for table, fn in ((self._pre, pre), (self._post, post)):
                    fns = table.get(key)
                    if fns is not None and fn in fns:
                        fns.remove(fn)
                        if not fns:
                            del table[key]
                self._uninstall()
        return stop

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
        if not self._handles:
            # torch warns that global hooks fire once more for a torch.compile(module) wrapper: ours
            # only act on the watched module itself, so that extra call is a no-op
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self._handles = [nn.modules.module.register_module_forward_pre_hook(self._on_pre),
                             nn.modules.module.register_module_forward_hook(self._on_post, with_kwargs=True)]

    def _uninstall(self) -> None:
        if not self._pre and not self._post and not self._every and self._handles:
            for h in self._handles:
                h.remove()
            self._handles = []

    def _on_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._paused or torch.compiler.is_compiling():
            return None
        fns = self._pre.get(id(module))
        if fns:
            for fn in list(fns):
                _safe(fn, module, args)
        return None

    def _on_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._paused or torch.compiler.is_compiling():
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


def compiled_parts(model: Any) -> list[str]:
    """Names of the compiled parts of ``model`` (``torch.compile(m)`` wrappers, ``m.compile()``),
    ``""`` for the model itself; ``[]`` for an eager model. Host work only."""
    if model is None:
        return []
    found = []
    mods = model.named_modules() if isinstance(model, nn.Module) else []
    if getattr(model, "_orig_mod", None) is not None or getattr(model, "_compiled_call_impl", None) is not None:
        found.append("")
    for name, m in mods:
        if name and (getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"):
            found.append(name)
    return found

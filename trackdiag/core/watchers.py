"""Watchers of sessions: code that wants every :class:`~trackdiag.Diagnostics` session opened while it
is active (an Optuna trial's stopper, :mod:`trackdiag.integrations.optuna`).

A session calls :func:`opened` once, when it opens; each watcher registered with :func:`watch` is
called with the session. Costs: one list walk per session open, nothing per step.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

log = logging.getLogger("trackdiag")

_lock = threading.Lock()
_watchers: list[Callable[[Any], None]] = []


def watch(fn: Callable[[Any], None]) -> None:
    """Call ``fn(session)`` for every session that opens from now until :func:`unwatch`."""
    with _lock:
        _watchers.append(fn)


def unwatch(fn: Callable[[Any], None]) -> None:
    """Stop calling ``fn``; a no-op when it is not registered."""
    with _lock:
        if fn in _watchers:
            _watchers.remove(fn)


def opened(session: Any) -> None:
    """Tell every watcher that ``session`` opened. A watcher that raises is logged and skipped: it
    never stops the user's training from starting."""
    with _lock:
        current = list(_watchers)
    for fn in current:
        try:
            fn(session)
        except Exception:
            log.warning("trackdiag: a session watcher failed", exc_info=True)

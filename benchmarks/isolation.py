"""Each arm's turn hears only its own session's process-wide hooks.

trackdiag follows a model through hooks that live in the process, not on the model: torch's global
module forward hooks (:mod:`trackdiag.capture.forward_watch`: while any session watches forward calls, every
module call in the process takes PyTorch's slower ``_call_impl`` path), the global optimizer step
hooks (:mod:`trackdiag.capture.optimizers`: every optimizer step is told to every live session) and the
gradient tap's end-of-backward queue. The benchmark keeps all arms in one process (to interleave them
step by step), so without this the bare arm's module calls would pay for the advanced and extreme
sessions' forward watchers, and every session would pay for the others': the ratios would understate
what a user's one session costs, most on workloads of many small module calls (seq2seq: ~65 per step).

``alone(diag, model)`` brackets one turn: only ``diag``'s watchers, optimizer listener and tap are
installed (a root watched through its own call slot needs no global hook and is left as it is); an arm without a session (bare, disabled, peers) runs with none of them. Everything is put
back after the turn, including watchers the session added or removed during it.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

from torch import nn

from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.gradtap import TAP_QUEUE
from trackdiag.capture.optimizers import DISPATCH


def _owned(fn: Any, ctx: Any) -> bool:
    """Whether a ``watch_all`` function belongs to the session whose probe context is ``ctx``."""
    return ctx is not None and getattr(getattr(fn, "__self__", None), "ctx", None) is ctx


@contextlib.contextmanager
def alone(diag: Any, model: nn.Module) -> Iterator[None]:
    """Run the body with only ``diag``'s process-wide hooks (none when ``diag`` is None or disabled)."""
    session = diag if getattr(diag, "enabled", False) and hasattr(diag, "_ctx") else None
    ctx = session._ctx if session is not None else None
    ids = {id(m) for m in model.modules()}
    others = [f for f in FORWARD._every if not _owned(f, ctx)]
    FORWARD._every = [f for f in FORWARD._every if _owned(f, ctx)]
    watched = bool(FORWARD._every) or any(k in ids for k in (*FORWARD._pre, *FORWARD._post))
    if not watched and FORWARD._handles:  # nothing of this arm needs the global module hooks
        for h in FORWARD._handles:
            h.remove()
        FORWARD._handles, FORWARD._pre_handle = [], None
    elif watched:
        FORWARD._install()
    listeners, DISPATCH._listeners = DISPATCH._listeners, weakref.WeakSet([session] if session is not None else [])
    taps = TAP_QUEUE.taps
    TAP_QUEUE.taps = [t for t in taps if session is not None and t is getattr(session, "_tap", None)]
    try:
        yield
    finally:
        TAP_QUEUE.taps = taps
        DISPATCH._listeners = listeners
        FORWARD._every = others + FORWARD._every
        if FORWARD._pre or FORWARD._post or FORWARD._every:
            FORWARD._install()

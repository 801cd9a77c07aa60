"""How the process (or a Hydra job) is ending, for sessions that are closed without an explicit status.

A session used without ``with`` is closed by ``atexit``; by then the exception that ended the
script is gone. :func:`install` (once per process, from the first session that opens) chains:

- ``sys.excepthook``: an uncaught exception in the main thread is remembered (``FAILED``;
  ``KeyboardInterrupt``: ``KILLED``), then the previous hook runs (the traceback prints as usual);
- ``threading.excepthook``: the same for the thread that opened a session (its training thread);
- ``SIGTERM`` (when installed from the main thread and the handler is the default or a Python
  function): remembered as ``KILLED``, then the previous handler runs; the default one becomes
  ``SystemExit(143)`` so ``finally`` blocks and ``atexit`` (the sessions' close) still run. A second
  SIGTERM, or one in a forked child, gets the default behaviour at once.

:func:`current` turns that into a status; :func:`exception` gives the exception itself (the ``crash``
finding of :mod:`trackdiag.session.flight` describes it) and :func:`signal_frame` the frame SIGTERM
interrupted. :func:`track`/:func:`close_job_sessions` let the Hydra callback close the sessions a
failed job left open (Hydra catches the job's exception itself and calls ``sys.exit(1)``, so no hook
sees it). Costs: nothing per step; a dict update per event.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import weakref
from types import FrameType, TracebackType
from typing import Any, Callable

log = logging.getLogger("trackdiag")

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"

_lock = threading.Lock()
_installed_pid: int | None = None
_signalled: str | None = None                 # KILLED once SIGTERM arrived
_uncaught: dict[int, str] = {}                # thread ident -> FAILED | KILLED (uncaught exception)
_errors: dict[int, BaseException] = {}        # thread ident -> the uncaught exception itself
_noted: "weakref.WeakKeyDictionary[Any, BaseException]" = weakref.WeakKeyDictionary()  # session -> exception given
_frame: list[FrameType | None] = [None]       # the frame SIGTERM interrupted
_main_ident = threading.main_thread().ident
_sessions: list[tuple[weakref.ref[Any], int, int]] = []   # (session, opening thread, job generation)
_job = 0


def status_of(exc: BaseException | None) -> str:
    """The run status an exception ending a run means: KeyboardInterrupt -> KILLED, SystemExit(0 or
    None) -> FINISHED, SystemExit from a SIGTERM -> KILLED, anything else -> FAILED; None -> FINISHED."""
    if exc is None:
        return FINISHED
    if isinstance(exc, KeyboardInterrupt) or (_signalled and isinstance(exc, SystemExit)):
        return KILLED
    if isinstance(exc, SystemExit):
        return FINISHED if exc.code in (0, None) else FAILED
    return FAILED


def current(session: Any = None) -> str:
    """How the run of ``session`` is ending, seen from where ``close()`` was called: SIGTERM ->
    KILLED; an exception being handled right now (close called in ``except``/``finally``); an
    uncaught exception in the main thread or in the session's own thread; else FINISHED."""
    if _signalled:
        return _signalled
    handling = sys.exc_info()[1]
    if handling is not None:
        return status_of(handling)
    thread = _thread_of(session)
    for ident in (_main_ident, thread):
        if ident is not None and ident in _uncaught:
            return _uncaught[ident]
    if not threading.main_thread().is_alive():  # at exit: the exception Python printed, if a hook was replaced
        last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if isinstance(last, BaseException):
            return status_of(last)
    return FINISHED


def note(session: Any, exc: BaseException | None) -> None:
    """Remember the exception that ends ``session``'s run (its ``with`` block's, a framework's)."""
    if exc is not None:
        try:
            _noted[session] = exc
        except TypeError:  # not weak-referenceable
            pass


def exception(session: Any = None) -> BaseException | None:
    """The exception ending the run of ``session``, seen from its ``close()``: the one noted for it
    (``with`` block, Hydra job), the one being handled right now, or the uncaught one of the main
    thread or of the session's own thread; None (also for SIGTERM outside a ``with``: see
    :func:`signal_frame`)."""
    noted = _noted.get(session) if session is not None else None
    if noted is not None:
        return noted
    handling = sys.exc_info()[1]
    if handling is not None:
        return handling
    thread = _thread_of(session)
    for ident in (_main_ident, thread):
        if ident is not None and ident in _errors:
            return _errors[ident]
    return None


def signalled() -> bool:
    """Whether SIGTERM arrived (and is ending the run)."""
    return _signalled is not None


def signal_frame() -> FrameType | None:
    """The Python frame SIGTERM interrupted (None before one arrived)."""
    return _frame[0]


def install() -> None:
    """Chain the hooks (idempotent per process; a forked child installs its own)."""
    global _installed_pid
    with _lock:
        if _installed_pid == os.getpid():
            return
        _installed_pid = os.getpid()
    prev_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _uncaught[threading.get_ident()] = status_of(value)
        _errors[threading.get_ident()] = value
        prev_hook(kind, value, tb)

    sys.excepthook = excepthook
    prev_thread_hook = threading.excepthook

    def thread_hook(args: Any) -> None:
        if args.exc_value is not None and args.thread is not None and args.thread.ident is not None:
            _uncaught[args.thread.ident] = status_of(args.exc_value)
            _errors[args.thread.ident] = args.exc_value
        prev_thread_hook(args)

    threading.excepthook = thread_hook
    _install_sigterm()


def _install_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        log.debug("trackdiag: session opened off the main thread; SIGTERM is not watched")
        return
    try:
        prev = signal.getsignal(signal.SIGTERM)
    except (ValueError, OSError):
        return
    if prev is signal.SIG_IGN or prev is None:
        return  # ignored on purpose, or set from C: leave it alone
    owner = os.getpid()

    def on_sigterm(signum: int, frame: FrameType | None) -> Any:
        global _signalled
        if os.getpid() != owner or _signalled or not _any_open():
            # a forked child, the second SIGTERM, or no session left to close: as if never installed
            if callable(prev):
                return prev(signum, frame)
            signal.signal(signal.SIGTERM, prev)
            os.kill(os.getpid(), signal.SIGTERM)
            return None
        _signalled = KILLED
        _frame[0] = frame
        if callable(prev):
            return prev(signum, frame)
        raise SystemExit(128 + signum)  # unwind: with-blocks and atexit close the sessions as KILLED

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except (ValueError, OSError):
        pass


def _any_open() -> bool:
    """Whether a tracked session is still open (one that SIGTERM should close as KILLED)."""
    live = [ref() for ref, _, _ in list(_sessions)]  # no lock: this runs in a signal handler
    return any(x is not None and not getattr(x, "_closed", True) for x in live)


def track(session: Any) -> None:
    """Remember an opened session (weakly), its thread and the current Hydra job generation."""
    with _lock:
        _sessions[:] = [s for s in _sessions if s[0]() is not None]
        _sessions.append((weakref.ref(session), threading.get_ident(), _job))


def job_started() -> None:
    """A Hydra job begins: sessions opened from now on belong to it."""
    global _job
    with _lock:
        _job += 1


def close_job_sessions(status: str, closer: Callable[[Any, str], None] | None = None,
                       exc: BaseException | None = None) -> int:
    """Close, with ``status``, the sessions opened during the current Hydra job and still open
    (``exc``: the job's exception, for their ``crash`` finding).
    Returns how many were closed. Each close delivers to the trackers (see the sinks' close)."""
    with _lock:
        mine = [ref() for ref, _, job in _sessions if job == _job]
    n = 0
    for session in mine:
        if session is not None and not getattr(session, "_closed", True):
            note(session, exc)
            (closer or (lambda s, st: s.close(st)))(session, status)
            n += 1
    return n


def _thread_of(session: Any) -> int | None:
    for ref, ident, _ in _sessions:
        if ref() is session:
            return ident
    return None


def _reset_for_tests() -> None:
    """Forget recorded events (tests that run sessions in one process)."""
    global _signalled
    _signalled = None
    _uncaught.clear()
    _errors.clear()
    _frame[0] = None

"""Blocks a Ctrl-C must not cut in half: a SIGINT inside waits until the block has ended.

A logging step's record is published probe by probe from one host copy (``Session._measured``);
a KeyboardInterrupt in the middle of a probe's ``publish`` left a record with that probe's values
missing (the loss series of the run's last window, in a Ctrl-C'd example job), and a probe that
had popped its values cannot publish them again (nor collect them: the collection is held too).
Collecting and publishing take about a millisecond each, so the signal is held for that long, then
raised as the KeyboardInterrupt it would have been.

Only on the main thread and only while Python's own SIGINT handler is installed: a handler the
user (or a framework: Lightning, Accelerate) installed is left alone.
"""
from __future__ import annotations

import _signal  # the C functions under ``signal``'s wrappers (which map each handler to an enum through a raised ValueError: ~5 us a call)
import contextlib
import signal
import threading
from typing import Any, Iterator

_SIGINT = int(signal.SIGINT)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold SIGINT for the block; a Ctrl-C received inside raises KeyboardInterrupt as it ends."""
    if (threading.current_thread() is not threading.main_thread()
            or _signal.getsignal(_SIGINT) is not signal.default_int_handler):
        yield
        return
    got: list[Any] = []
    _signal.signal(_SIGINT, lambda *args: got.append(args))
    try:
        yield
    finally:
        _signal.signal(_SIGINT, signal.default_int_handler)
        if got:
            raise KeyboardInterrupt

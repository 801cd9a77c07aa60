"""A pause counter for trackdiag's process-wide watchers: inside ``paused()`` they ignore what
happens (trackdiag's own forwards and optimizer steps: replays, the pre-flight's copies, landscapes).
Nested pauses count; the watchers read ``_paused`` (an int, no lock: one thread runs training)."""
from __future__ import annotations

import contextlib
from typing import Iterator


class Pausable:
    _paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is watched inside."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

"""A pause counter for trackdiag's process-wide watchers: inside ``paused()`` they ignore what
happens (trackdiag's own forwards and optimizer steps: replays, the pre-flight's copies, landscapes).
Nested pauses count; the watchers read ``_paused`` (an int, no lock: one thread runs training)."""
from __future__ import annotations

import contextlib
from typing import Iterator


class Pausable:
    """Subclasses call ``super().__init__()``: ``_paused`` lives in the instance from the start (a model
    compiled while it was still the class attribute would be recompiled at the first ``paused()``:
    Dynamo guards on where the attribute is found)."""

    def __init__(self) -> None:
        self._paused = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Nothing is watched inside. The count is set inside the ``try`` and restored to what it was
        (not decremented): a KeyboardInterrupt on either side of the change leaves it right."""
        before = self._paused
        try:
            self._paused = before + 1
            yield
        finally:
            self._paused = before

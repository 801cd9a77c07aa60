"""Data-wait probe: how much of the wall time the loop spends waiting for the next batch.

Use ``for batch in diag.wrap_loader(loader):`` — the wrapper times each ``next()`` on the host clock
(``time.perf_counter``; no device work, no sync). Emits:
  ``diag/data/wait_ms``: mean wait per batch fetched in the window;
  ``diag/data/wait_share``: wait time / wall time of the window (0..1);
  ``diag/data/batches``: batches fetched in the window; ``diag/data/window_s``: its wall time.
The first batch of every ``iter(loader)`` (worker start-up, a new epoch's shuffle) is left out of
both the wait and the wall time, so start-up never reads as a bottleneck. Without a wrapped loader
the probe emits nothing. Cost: two ``perf_counter`` calls per batch.
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Iterator

from trackdiag.capture.context import ProbeContext
from trackdiag.probes.base import Probe


class TimedLoader:
    """Iterates ``loader`` like the original (``len``, attributes pass through) and reports the
    time spent inside each ``next()`` to ``probe``."""

    def __init__(self, loader: Iterable[Any], probe: "DataWaitProbe") -> None:
        self.loader = loader
        self._probe = probe

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        first = True
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            self._probe.add(time.perf_counter() - t0, first)
            first = False
            yield batch

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # dataset, sampler, batch_size, set_epoch ...
        loader = self.__dict__.get("loader")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)


class DataWaitProbe(Probe):
    """See module docstring."""

    name = "data_wait"
    always_collect = True  # the last, partial window counts too

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._wait = 0.0
        self._excluded = 0.0
        self._batches = 0
        self._t0: float | None = None

    def wrap(self, loader: Iterable[Any]) -> TimedLoader:
        """``loader`` wrapped so its waits are measured."""
        return TimedLoader(loader, self)

    def add(self, seconds: float, first: bool) -> None:
        """One ``next()`` took ``seconds``; ``first`` of its iterator (excluded)."""
        if self._t0 is None:
            self._t0 = time.perf_counter() - seconds
        if first:
            self._excluded += seconds
        else:
            self._wait += seconds
            self._batches += 1

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        if self._t0 is None:
            return {}
        now = time.perf_counter()
        wall = now - self._t0 - self._excluded
        out: dict[str, Any] = {}
        if self._batches and wall > 0:
            out = {"diag/data/wait_ms": 1e3 * self._wait / self._batches, "diag/data/batches": float(self._batches),
                   "diag/data/wait_share": min(self._wait / wall, 1.0), "diag/data/window_s": wall}
        self._t0, self._wait, self._excluded, self._batches = now, 0.0, 0.0, 0
        return out

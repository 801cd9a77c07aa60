"""A thread pool's ``map`` that still works while the interpreter shuts down.

A Hydra sweep's end can run in the launcher's ``atexit`` handler (a failed or killed job makes Hydra skip
``on_multirun_end``: :mod:`trackdiag.hydra.callback`). By then ``concurrent.futures`` refuses new work ("cannot
schedule new futures after interpreter shutdown"; a first import of ``concurrent.futures.thread`` then: "can't register
atexit after shutdown"), and a ``ThreadPoolExecutor`` there raised: the sweep's parent run was left RUNNING, its
comparison unlogged. :func:`thread_map` falls back to one thread then.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def thread_map(fn: Callable[[T], R], items: Iterable[T], threads: int, name: str = "trackdiag") -> Iterator[R]:
    """``fn`` over ``items`` on up to ``threads`` threads, results in order as they come (the first failure re-raised
    when its turn comes); in the calling thread when there is one item or thread, or when the interpreter is shutting
    down."""
    work = list(items)
    if threads > 1 and len(work) > 1:
        pool = None
        try:
            # imported here: a first import of concurrent.futures.thread at exit raises too ("can't register atexit")
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(min(threads, len(work)), thread_name_prefix=name)
            results = pool.map(fn, work)  # every item submitted now: refused at shutdown, before any ran
        except RuntimeError as e:
            if pool is not None:
                pool.shutdown(wait=False)
            if "shutdown" not in str(e):
                raise
        else:
            with pool:
                yield from results
            return
    for item in work:
        yield fn(item)

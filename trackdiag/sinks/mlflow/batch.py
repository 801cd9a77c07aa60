"""Coalescing: queued ops become the fewest MLflow calls that MLflow's limits allow.

The deliverer hands the runner *groups* of consecutive ops (:func:`group_end`): ``open`` alone,
then as many data ops as fit a group's budget, an ``end`` op closing its group. The runner merges a
group's metric points, params and tags into ``log_batch`` calls packed up to the limits
(:func:`pack`: <= 1000 metrics, <= 100 params, <= 100 tags, <= 1000 entities, < ~0.9 MB of JSON)
and its files and histogram images into one upload. Every op stays the unit of the spool; a group
is retried whole (MLflow keeps one copy of a metric point sent twice; files are overwritten).
Pure functions over plain data: no MLflow import, no I/O.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from trackdiag.sinks.mlflow.ops import MAX_BYTES, MAX_METRICS, MAX_PARAMS_TAGS, op_size

MAX_ENTITIES = 1000      # MAX_ENTITIES_PER_BATCH: metrics + params + tags in one log_batch
GROUP_POINTS = 20_000    # metric points per group (<= ~20 log_batch calls between two spool rewrites)
GROUP_FILES = 256        # files + images per group


def group_end(ops: Sequence[dict[str, Any]], start: int = 0, max_points: int = GROUP_POINTS,
              max_files: int = GROUP_FILES) -> int:
    """The end (exclusive) of the group that begins at ``ops[start]``: ``open`` is a group of its
    own; otherwise ops are taken until the next ``open``, through the first ``end``, or until the
    budget (points, files) is used (always at least one op)."""
    if start >= len(ops):
        return start
    if ops[start].get("op") == "open":
        return start + 1
    points = files = 0
    i = start
    while i < len(ops):
        op = ops[i]
        kind = op.get("op")
        if kind == "open":
            break
        size = op_size(op)
        is_file = kind in ("artifact", "image")
        if i > start and (points + (size if kind == "points" else 0) > max_points or files + is_file > max_files):
            break
        points += size if kind == "points" else 0
        files += is_file
        i += 1
        if kind == "end":
            break
    return i


def pack(metrics: Sequence[Any], params: Sequence[Any], tags: Sequence[Any],
         size: Callable[[Any], int]) -> Iterator[tuple[list[Any], list[Any], list[Any]]]:
    """``(metrics, params, tags)`` lists for successive ``log_batch`` calls, each within MLflow's
    limits; ``size(entity)`` estimates an entity's JSON bytes. Params and tags ride along with the
    first metrics, so a group with 2,400 points and 30 tags is three calls, not four."""
    queues = ((params, MAX_PARAMS_TAGS, 1), (tags, MAX_PARAMS_TAGS, 2), (metrics, MAX_METRICS, 0))
    pos = [0, 0, 0]
    while any(pos[i] < len(q[0]) for i, q in enumerate(queues)):
        out: tuple[list[Any], list[Any], list[Any]] = ([], [], [])
        total = nbytes = 0
        for i, (source, cap, slot) in enumerate(queues):
            while pos[i] < len(source) and len(out[slot]) < cap and total < MAX_ENTITIES:
                est = size(source[pos[i]])
                if total and nbytes + est > MAX_BYTES:
                    break
                out[slot].append(source[pos[i]])
                nbytes += est
                total += 1
                pos[i] += 1
        yield out


def group_summary(ops: Sequence[dict[str, Any]]) -> tuple[int, int]:
    """(metric points, files and images) an op list carries: what "is left" at close."""
    points = files = 0
    for op in ops:
        if op.get("op") in ("artifact", "image"):
            files += 1
        elif op.get("op") == "points":
            points += op_size(op)
    return points, files

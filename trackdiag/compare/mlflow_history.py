"""Metric histories of many runs in few calls: a sweep's loss curves read from an MLflow server.

``MlflowClient.get_metric_history`` is one request per run and key: 1,000 requests for the loss
and eval curves of 500 runs (~30 s against a PostgreSQL-backed server on 2 busy cores). The
tracking server also answers ``GET /ajax-api/2.0/mlflow/metrics/get-history-bulk`` (what its UI
charts use: up to 100 runs and 25,000 points per request, one SQL query), and a SQL store has
the same ``get_metric_history_bulk``. :func:`histories` packs runs into such requests by their
expected number of points, re-asks for the runs a full answer cut off, and runs the requests on a
few threads. Where neither exists (another kind of server or store), it returns None and the
caller reads run by run.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from trackdiag.util.pool import thread_map

log = logging.getLogger(__name__)

MAX_RUNS = 100          # the server's MAX_RUN_IDS_PER_REQUEST
MAX_POINTS = 25_000     # the server's MAX_HISTORY_RESULTS
ENDPOINT = "/ajax-api/2.0/mlflow/metrics/get-history-bulk"
THREADS = 4

Fetch = Callable[[list[str], str], list[tuple[str, int, float]]]


def _fetcher(client: Any) -> Fetch | None:
    """(run ids, key) -> [(run id, step, value), ...] for this client's store, sorted by run id then
    timestamp (the server's order), or None when the store has no bulk read."""
    store = getattr(getattr(client, "_tracking_client", None), "store", None)
    if hasattr(store, "get_metric_history_bulk"):  # a SQL store
        def sql(run_ids: list[str], key: str) -> list[tuple[str, int, float]]:
            got = store.get_metric_history_bulk(run_ids=run_ids, metric_key=key, max_results=MAX_POINTS)
            return [(m.run_id, int(m.step), float(m.value)) for m in got]
        return sql
    creds = getattr(store, "get_host_creds", None)
    if creds is None:
        return None
    from mlflow.utils.rest_utils import http_request

    def rest(run_ids: list[str], key: str) -> list[tuple[str, int, float]]:
        resp = http_request(creds(), ENDPOINT, "GET", params={"run_id": run_ids, "metric_key": key,
                                                             "max_results": MAX_POINTS}, max_retries=2)
        if resp.status_code == 404:
            raise LookupError("no bulk metric history on this server")
        resp.raise_for_status()
        return [(m["run_id"], int(m.get("step", 0)), float(m["value"])) for m in resp.json().get("metrics", [])]
    return rest


def _batches(expected: dict[str, int]) -> list[list[str]]:
    """Run ids packed into requests of <= 100 runs and (by expectation) <= 25,000 points."""
    out: list[list[str]] = []
    cur: list[str] = []
    points = 0
    for run_id in sorted(expected):
        n = max(1, expected[run_id])
        if cur and (len(cur) >= MAX_RUNS or points + n > MAX_POINTS):
            out.append(cur)
            cur, points = [], 0
        cur.append(run_id)
        points += n
    if cur:
        out.append(cur)
    return out


def _one_batch(fetch: Fetch, single: Callable[[str], list[tuple[int, float]]], run_ids: list[str],
               key: str) -> dict[str, list[tuple[int, float]]]:
    """Every point of ``key`` for ``run_ids``. A cut answer (exactly 25,000 points) is trusted only for
    the runs before the last one it reached; that one and the rest are asked again. A run that alone
    fills an answer is read by ``single`` (the client's paged history)."""
    out: dict[str, list[tuple[int, float]]] = {r: [] for r in run_ids}
    todo = sorted(run_ids)
    while todo:
        got = fetch(todo, key)
        last = got[-1][0] if len(got) >= MAX_POINTS else None
        for run_id, step, value in got:
            if last is None or run_id < last:
                out[run_id].append((step, value))
        if last is None:
            return out
        if last == todo[0]:  # one run holds a full answer or more
            out[last] = single(last)
            last = todo[1] if len(todo) > 1 else None
            if last is None:
                return out
        todo = [r for r in todo if r >= last]
    return out


def histories(client: Any, expected: dict[str, int], key: str) -> dict[str, list[tuple[int, float]]] | None:
    """Run id -> [(step, value), ...] of metric ``key`` for every run in ``expected`` (run id -> the
    points it should hold, for packing), in ~points/25,000 requests; None when the store has no bulk
    read (the caller then reads run by run)."""
    fetch = _fetcher(client)
    if fetch is None or not expected:
        return None if fetch is None else {}

    def single(run_id: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    out: dict[str, list[tuple[int, float]]] = {}
    try:
        for part in thread_map(lambda batch: _one_batch(fetch, single, batch, key), _batches(expected), THREADS):
            out.update(part)
    except LookupError as e:
        log.debug("trackdiag compare: %s; reading run by run", e)
        return None
    for points in out.values():
        points.sort()
    return out

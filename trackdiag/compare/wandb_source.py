"""Read a sweep from a W&B server: ``wandb:<entity>/<project>[/<group>]``.

``wandb.Api()`` needs a reachable server (``WANDB_BASE_URL``, default https://api.wandb.ai) and an
API key; offline runs can't be read this way — compare their local trackdiag records instead.
Before creating the API client this module checks that the server's port accepts a TCP
connection (a few seconds at most), so an unreachable server gives one clear error, not a hang.
Per run it reads the summary keys the trackdiag W&B sink writes: ``trackdiag/alerts/<kind>/count``,
``trackdiag/alerts/<kind>/first_step``, ``trackdiag/health``, the config (flattened) and a sampled
``diag/loss`` / ``diag/eval/loss`` history (one history call per run).
"""
from __future__ import annotations

import logging
import os
import re
import socket
from typing import Any, Mapping
from urllib.parse import urlparse

from trackdiag.compare.runs import (
    MAX_CURVE_POINTS,
    CompareError,
    Progress,
    RunSummary,
    best_finite,
    first_anomaly,
    flatten,
    loss_stats,
)

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://api.wandb.ai"
ALERT_PREFIX = "trackdiag/alerts/"
HEALTH_KEY = "trackdiag/health"
STATES = {"finished": "FINISHED", "failed": "FAILED", "crashed": "CRASHED", "killed": "KILLED", "running": "RUNNING"}
_JOB_NUM = re.compile(r"#(\d+)$")


def load_wandb(spec: str, *, progress: Progress | None = None, timeout: float = 3.0) -> list[RunSummary]:
    """The runs of ``<entity>/<project>`` (only group ``<group>`` if given).

    Raises :class:`CompareError` on a malformed spec, a missing ``wandb`` package, an unreachable
    server or an API error (no API key, unknown project).
    """
    parts = [p for p in spec.strip().strip("/").split("/") if p]
    if len(parts) < 2:
        raise CompareError(f"bad W&B source {spec!r}: expected wandb:<entity>/<project>[/<group>]")
    path, group = f"{parts[0]}/{parts[1]}", "/".join(parts[2:]) or None
    try:
        import wandb
    except ImportError as e:
        raise CompareError("reading W&B needs wandb: pip install 'trackdiag[wandb]'") from e
    base = os.environ.get("WANDB_BASE_URL") or DEFAULT_BASE_URL
    check_reachable(base, timeout)
    try:
        api = wandb.Api(overrides={"base_url": base}, timeout=30)
        found = list(api.runs(path, filters={"group": group} if group else None))
    except Exception as e:  # wandb raises its own CommError/UsageError/ValueError types
        raise CompareError(f"W&B at {base}: {type(e).__name__}: {e}") from e
    runs: list[RunSummary] = []
    for i, run in enumerate(found, 1):
        runs.append(run_summary(run))
        if progress:
            progress(i, len(found))
    return runs


def check_reachable(base_url: str, timeout: float = 3.0) -> None:
    """Raise :class:`CompareError` unless ``base_url``'s host accepts a TCP connection in ``timeout`` s."""
    url = urlparse(base_url)
    host = url.hostname
    port = url.port or (443 if url.scheme == "https" else 80)
    if not host:
        raise CompareError(f"bad W&B base URL {base_url!r}")
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except OSError as e:
        raise CompareError(
            f"W&B server {base_url} is not reachable ({e}). wandb.Api() needs a server; set WANDB_BASE_URL "
            "for a local one, or compare the runs' local trackdiag records: trackdiag compare <sweep dir>"
        ) from e


def run_summary(run: Any) -> RunSummary:
    """One W&B API run as a :class:`RunSummary`."""
    summary = _flat_slash(dict(run.summary) if run.summary is not None else {})
    counts: dict[str, int] = {}
    firsts: dict[str, int] = {}
    for key, value in summary.items():
        if not key.startswith(ALERT_PREFIX) or value is None:
            continue
        kind, _, field = key[len(ALERT_PREFIX):].rpartition("/")
        if kind and field == "count":
            counts[kind] = int(value)
        elif kind and field == "first_step":
            firsts[kind] = int(value)
    health = str(summary.get(HEALTH_KEY) or "unknown")
    train: list[tuple[int, float]] = []
    evals: list[float] = []
    for row in _history(run, ["diag/loss", "diag/eval/loss"]):
        step = row.get("_step")
        if row.get("diag/loss") is not None and step is not None:
            train.append((int(step), float(row["diag/loss"])))
        if row.get("diag/eval/loss") is not None:
            evals.append(float(row["diag/eval/loss"]))
    final, best, curve = loss_stats(train)
    name = str(run.name or run.id)
    match = _JOB_NUM.search(name)
    sevs = {} if health != "ok" else {k: "info" for k in firsts}
    return RunSummary(
        name=name, source_id="/".join(str(p) for p in getattr(run, "path", [run.id])),
        status=STATES.get(str(run.state).lower(), str(run.state).upper()), health=health,
        hparams=flatten({k: v for k, v in dict(run.config).items() if not str(k).startswith("_")}),
        alert_counts=counts, first_steps=firsts, first_anomaly=first_anomaly(firsts, sevs),
        steps=(max(s for s, _ in train) + 1) if train else None, final_loss=final, best_loss=best,
        best_eval_loss=best_finite(evals), loss_curve=curve,
        job_num=int(match.group(1)) if match else None, group=getattr(run, "group", None),
        diagnosed=any(str(k).startswith("trackdiag/") for k in summary) or "trackdiag" in dict(run.config),
    )


def _history(run: Any, keys: list[str]) -> list[dict[str, Any]]:
    """Sampled history rows holding any of ``keys`` (one API call per key)."""
    rows: list[dict[str, Any]] = []
    for key in keys:
        try:
            rows += list(run.history(keys=[key], samples=MAX_CURVE_POINTS * 2, pandas=False))
        except Exception as e:  # a key never logged, or an API hiccup: the curve is optional
            log.debug("no %s history for %s: %s", key, getattr(run, "id", "?"), e)
    return rows


def _flat_slash(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Summary dict with nested mappings joined by ``/`` (W&B may nest ``trackdiag/alerts/...``)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and not {"_type"} & set(v):
            out.update(_flat_slash(v, key + "/"))
        else:
            out[key] = v
    return out

"""Read a sweep from MLflow: ``mlflow:<experiment name or id>`` [``--parent <run id>``].

What the trackdiag MLflow sink logs per run and this reader uses: params = flattened hparams
(dotted keys, values as text), tag ``trackdiag.health``, tag ``trackdiag.alert.<kind>`` = first step,
metric ``diag/alerts/<kind>`` = count, metric ``diag/loss`` (per step), ``diag/eval/loss``. A Hydra
multirun has a parent run (tag ``trackdiag.role=sweep``); its jobs are children
(``mlflow.parentRunId``, tag ``trackdiag.job_num``). Without ``--parent`` every run of the experiment is read except parents.
A run with no ``trackdiag.*`` tag never ran trackdiag: it is listed as ``no trackdiag`` (with its own status).
Cost: one ``search_runs`` call per page of runs plus two metric-history calls per run.
"""
from __future__ import annotations

import logging
import os
import re
import urllib.error
import urllib.request
from typing import Any, Iterator

from trackdiag.compare.runs import (CompareError, Progress, RunSummary, best_finite, loss_stats, parse_value)

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "trackdiag.role"
SWEEP_TAG = "trackdiag.sweep"
HEALTH_TAG = "trackdiag.health"
JOB_NUM_TAG = "trackdiag.job_num"
ALERT_TAG_PREFIX = "trackdiag.alert."
ALERT_METRIC_PREFIX = "diag/alerts/"
LOSS, EVAL_LOSS = "diag/loss", "diag/eval/loss"
_JOB_NUM = re.compile(r"#(\d+)$")


def load_mlflow(spec: str, *, tracking_uri: str | None = None, parent: str | None = None,
                progress: Progress | None = None, page_size: int = 1000) -> list[RunSummary]:
    """The runs of experiment ``spec`` (name or id), or only the children of ``parent``.

    Raises :class:`CompareError` when mlflow is missing, no tracking URI is set, the server does
    not answer, or the experiment does not exist.
    """
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise CompareError("reading MLflow needs mlflow: pip install mlflow") from e
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise CompareError("no MLflow tracking URI: pass --tracking-uri URI or set MLFLOW_TRACKING_URI")
    _check_server(uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        exp_id = _experiment_id(client, spec, uri)
        flt = f"tags.`{PARENT_TAG}` = '{_quote(parent)}'" if parent else ""
        found = list(_search(client, exp_id, flt, page_size))
    except MlflowException as e:
        raise CompareError(f"MLflow at {uri}: {e}") from e
    if not parent:  # sweep parents only aggregate their children
        parents = {r.data.tags.get(PARENT_TAG) for r in found}
        found = [r for r in found if r.info.run_id not in parents and r.data.tags.get(ROLE_TAG) != "sweep"]
    runs: list[RunSummary] = []
    for i, run in enumerate(found, 1):
        runs.append(run_summary(client, run))
        if progress:
            progress(i, len(found))
    return runs


def run_summary(client: Any, run: Any) -> RunSummary:
    """One MLflow run as a :class:`RunSummary` (two metric-history calls for the loss curves)."""
    tags: dict[str, str] = run.data.tags
    metrics: dict[str, float] = run.data.metrics
    firsts: dict[str, int] = {}
    counts: dict[str, int] = {}
    for key, value in tags.items():
        if key.startswith(ALERT_TAG_PREFIX):
            kind = key[len(ALERT_TAG_PREFIX):]
            try:
                firsts[kind] = int(float(value))
            except ValueError:
                continue
            counts[kind] = 1
    for key, value in metrics.items():
        if key.startswith(ALERT_METRIC_PREFIX):
            kind = key[len(ALERT_METRIC_PREFIX):]
            counts[kind] = int(value)
    counts = {k: n for k, n in counts.items() if n > 0 or k in firsts}
    health = tags.get(HEALTH_TAG) or ("unknown" if not counts else "warning")
    run_id = run.info.run_id
    train = [(m.step, m.value) for m in client.get_metric_history(run_id, LOSS)]
    evals = [m.value for m in client.get_metric_history(run_id, EVAL_LOSS)]
    final, best, curve = loss_stats(train)
    name = run.info.run_name or run_id
    match = _JOB_NUM.search(name)
    status = run.info.status
    diagnosed = any(k.startswith("trackdiag.") for k in tags)  # level, version, ... from the sink's first call
    note = ""
    if not diagnosed:
        note = "not a trackdiag run (no trackdiag.* tags)"
    elif status == "RUNNING" and HEALTH_TAG not in tags:
        note = "no trackdiag.health tag: still running, or the process died before trackdiag closed"
    return RunSummary(
        name=name, source_id=run_id, status=status, health=health,
        hparams={k: parse_value(v) for k, v in run.data.params.items()},
        alert_counts=counts, first_steps=firsts,
        first_anomaly=min(firsts.values()) if firsts and health != "ok" else None,
        steps=(max(s for s, _ in train) + 1) if train else None, final_loss=final, best_loss=best,
        best_eval_loss=best_finite(evals), loss_curve=curve,
        job_num=_job_num(tags.get(JOB_NUM_TAG)) if JOB_NUM_TAG in tags else (
            int(match.group(1)) if match and SWEEP_TAG in tags else None),
        group=tags.get(PARENT_TAG) or tags.get(SWEEP_TAG), note=note, diagnosed=diagnosed,
    )


def _search(client: Any, exp_id: str, flt: str, page_size: int) -> Iterator[Any]:
    """Every run matching ``flt``, page by page (``page_token``) so no run is silently cut off."""
    token: str | None = None
    while True:
        page = client.search_runs([exp_id], filter_string=flt, max_results=page_size, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def _experiment_id(client: Any, spec: str, uri: str) -> str:
    """The id of the experiment named ``spec``, or ``spec`` itself if it is an existing id."""
    exp = client.get_experiment_by_name(spec)
    if exp is None and spec.isdigit():
        try:
            exp = client.get_experiment(spec)
        except Exception:  # MlflowException: RESOURCE_DOES_NOT_EXIST
            exp = None
    if exp is None:
        names = [e.name for e in client.search_experiments(max_results=20)]
        raise CompareError(f"no MLflow experiment {spec!r} at {uri}; experiments there: {', '.join(names) or 'none'}")
    return str(exp.experiment_id)


def _check_server(uri: str, timeout: float = 5.0) -> None:
    """For http(s) URIs, fail fast if ``<uri>/health`` does not answer (the client retries for minutes)."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout) as resp:
            if resp.status < 500:
                return
    except urllib.error.HTTPError as e:  # it answered: a 4xx means "up" (older servers lack /health)
        if e.code < 500:
            return
    except OSError as e:
        raise CompareError(f"MLflow server {uri} does not answer ({e}); start it or check --tracking-uri") from e
    raise CompareError(f"MLflow server {uri} is unhealthy")


def _job_num(text: str | None) -> int | None:
    """The ``trackdiag.job_num`` tag as an int (``"None"`` outside sweeps)."""
    try:
        return int(str(text))
    except ValueError:
        return None


def _quote(text: str) -> str:
    """Escape single quotes for an MLflow filter string."""
    return text.replace("'", "\\'")

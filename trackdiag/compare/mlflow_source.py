"""Read a sweep from MLflow: ``mlflow:<experiment name or id>`` [``--parent <run id>`` | ``--sweep <id>``].

A sweep that lives only on a server (its jobs ran on other machines) is read by its parent run
(``--parent``; the experiment may then be left out: ``mlflow:``), by its Hydra sweep id
(``--sweep 2026-06-01/12-00-00``, the end of the sweep dir, matched against the parents' tag
``trackdiag.sweep``), or as a whole experiment.

What the trackdiag MLflow sink logs per run and this reader uses: params = flattened hparams
(dotted keys, values as text), tag ``trackdiag.health``, tag ``trackdiag.alert.<kind>`` = first step,
metric ``diag/alerts/<kind>`` = count, metric ``diag/loss`` (per step), ``diag/eval/loss``. A Hydra
multirun has a parent run (tag ``trackdiag.role=sweep``); its jobs are children
(``mlflow.parentRunId``, tag ``trackdiag.job_num``). Without ``--parent`` every run of the experiment is read except parents.
A run with no ``trackdiag.*`` tag never ran trackdiag: it is listed as ``no trackdiag`` (with its own status).
The sink's ``trackdiag.summary`` tag (steps, health, every alert kind's count, first step and
severity) gives each run's alerts straight from the search page, so the table, risk lines and
plots match the ones from local records. Cost: one ``search_runs`` call per page of 1000 runs,
plus the loss and eval curves read in bulk (:mod:`~trackdiag.compare.mlflow_history`: ~1 request
per 25,000 points); where the store has no bulk read, one metric-history call per run and curve,
16 at a time against a server.
"""
from __future__ import annotations

import json
import logging
import os
import re
import urllib.error
import urllib.request
from typing import Any, Iterator

from trackdiag.compare.runs import (
    HEALTH_RANK,
    CompareError,
    Progress,
    RunSummary,
    best_finite,
    first_anomaly,
    loss_stats,
    parse_value,
    training_health,
)
from trackdiag.sinks.mlflow.sweep import literal
from trackdiag.util.pool import thread_map

log = logging.getLogger(__name__)

PARENT_TAG = "mlflow.parentRunId"
ROLE_TAG = "trackdiag.role"
SWEEP_TAG = "trackdiag.sweep"
HEALTH_TAG = "trackdiag.health"
JOB_NUM_TAG = "trackdiag.job_num"
SUMMARY_TAG = "trackdiag.summary"
THREADS = 16
ALERT_TAG_PREFIX = "trackdiag.alert."
ALERT_METRIC_PREFIX = "diag/alerts/"
LOSS, EVAL_LOSS = "diag/loss", "diag/eval/loss"
_JOB_NUM = re.compile(r"#(\d+)$")


def load_mlflow(spec: str, *, tracking_uri: str | None = None, parent: str | None = None, sweep: str | None = None,
                progress: Progress | None = None, page_size: int = 1000) -> list[RunSummary]:
    """The runs of experiment ``spec`` (name or id; may be empty with ``parent``), only the children of
    ``parent``, or only those of the sweep whose dir ends with ``sweep`` (a Hydra sweep id).

    Raises :class:`CompareError` when mlflow is missing, no tracking URI is set, the server does
    not answer, or the experiment, parent or sweep does not exist.
    """
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError as e:
        raise CompareError("reading MLflow needs mlflow: pip install mlflow") from e
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise CompareError("no MLflow tracking URI: pass --tracking-uri URI or set MLFLOW_TRACKING_URI")
    if not spec and not parent and not sweep:
        raise CompareError("name an experiment (mlflow:<experiment>), or pass --parent RUN_ID or --sweep SWEEP_ID")
    _check_server(uri)
    client = MlflowClient(tracking_uri=uri)
    try:
        exp_ids = [_experiment_id(client, spec, uri)] if spec else None
        if parent and exp_ids is None:
            exp_ids = [_parent_run(client, parent, uri).info.experiment_id]
        if sweep:
            exp_ids = exp_ids or [e.experiment_id for e in client.search_experiments(max_results=1000)]
            parent = _sweep_parent(client, exp_ids, sweep, uri)
        flt = f"tags.`{PARENT_TAG}` = {literal(parent) or repr(parent)}" if parent else ""
        found = list(_search(client, exp_ids or [], flt, page_size))
    except MlflowException as e:
        raise CompareError(f"MLflow at {uri}: {e}") from e
    if not parent:  # sweep parents only aggregate their children
        parents = {r.data.tags.get(PARENT_TAG) for r in found}
        found = [r for r in found if r.info.run_id not in parents and r.data.tags.get(ROLE_TAG) != "sweep"]
    from trackdiag.compare.mlflow_history import histories

    expected = {r.info.run_id: _expected_points(r) for r in found if LOSS in r.data.metrics}
    train = histories(client, expected, LOSS)  # ~1 request per 25,000 points, not one per run
    evals = histories(client, {r.info.run_id: 100 for r in found if EVAL_LOSS in r.data.metrics}, EVAL_LOSS) \
        if train is not None else None
    threads = THREADS if uri.startswith(("http://", "https://")) and train is None else 1
    done = 0

    def one(run: Any) -> RunSummary:
        rid = run.info.run_id
        return run_summary(client, run, None if train is None else train.get(rid, []),
                           None if evals is None else [v for _, v in evals.get(rid, [])])

    runs: list[RunSummary] = []
    for summary in thread_map(one, found, threads):
        runs.append(summary)
        done += 1
        if progress:
            progress(done, len(found))
    return runs


def _parent_run(client: Any, run_id: str, uri: str) -> Any:
    """The run ``run_id`` (a sweep's parent), or :class:`CompareError`."""
    try:
        return client.get_run(run_id)
    except Exception as e:  # MlflowException: RESOURCE_DOES_NOT_EXIST
        raise CompareError(f"no MLflow run {run_id!r} at {uri} ({type(e).__name__})") from e


def _sweep_parent(client: Any, exp_ids: list[str], sweep: str, uri: str) -> str:
    """The parent run of the sweep whose dir ends with ``sweep`` (``12-00-00``, ``2026-06-01/12-00-00`` or
    the whole dir); :class:`CompareError` if none or several sweeps match."""
    tail = sweep.rstrip("/")
    like = literal(f"%{tail}")
    flt = f"tags.`{ROLE_TAG}` = 'sweep'" + (f" and tags.`{SWEEP_TAG}` LIKE {like}" if like else "")
    found = [r for r in _search(client, exp_ids, flt, 1000)
             if (r.data.tags.get(SWEEP_TAG, "") == tail or r.data.tags.get(SWEEP_TAG, "").endswith("/" + tail))]
    dirs = sorted({r.data.tags[SWEEP_TAG] for r in found})
    if not dirs:
        raise CompareError(f"no sweep {sweep!r} at {uri} (no parent run whose trackdiag.sweep tag ends with it)")
    if len(dirs) > 1:
        raise CompareError(f"{len(dirs)} sweeps match {sweep!r} at {uri}: {', '.join(dirs[:5])}; give more of the dir")
    return str(min(found, key=lambda r: (r.info.start_time or 0, r.info.run_id)).info.run_id)


def run_summary(client: Any, run: Any, train: list[tuple[int, float]] | None = None,
                evals: list[float] | None = None) -> RunSummary:
    """One MLflow run as a :class:`RunSummary`: alerts from its ``trackdiag.summary`` tag (else from
    its alert tags and metrics); the loss curve and eval losses as given (read in bulk), else one
    metric-history call each when the run has them."""
    tags: dict[str, str] = run.data.tags
    metrics: dict[str, float] = run.data.metrics
    summary = _summary(tags.get(SUMMARY_TAG))
    sevs: dict[str, str] = {}
    if summary is not None:
        counts = {k: int(v[0]) for k, v in summary["alerts"].items()}
        firsts = {k: int(v[1]) for k, v in summary["alerts"].items() if isinstance(v[1], (int, float))}
        sevs = {k: str(v[2]) for k, v in summary["alerts"].items()}
        health = training_health(str(summary.get("health") or "ok"), sevs)
    else:  # a run from before the summary tag, or one whose process died before trackdiag closed
        counts, firsts = _alerts_from_tags(tags, metrics)
        health = tags.get(HEALTH_TAG) or ("unknown" if not counts else "warning")
        if health not in HEALTH_RANK:  # failed / killed: the display health says it from the status
            health = "warning" if counts else "ok"
    run_id = run.info.run_id
    if train is None:
        train = [(m.step, m.value) for m in client.get_metric_history(run_id, LOSS)] if LOSS in metrics else []
    if evals is None:
        evals = [m.value for m in client.get_metric_history(run_id, EVAL_LOSS)] if EVAL_LOSS in metrics else []
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
    steps = summary.get("steps") if summary is not None else None
    if sevs:
        anomaly = first_anomaly(firsts, sevs)
    else:
        anomaly = min(firsts.values()) if firsts and health != "ok" else None
    return RunSummary(
        name=name, source_id=run_id, status=status, health=health,
        hparams={k: parse_value(v) for k, v in run.data.params.items()},
        alert_counts=counts, first_steps=firsts, severities=sevs, first_anomaly=anomaly,
        steps=int(steps) if isinstance(steps, (int, float)) else (max(s for s, _ in train) + 1) if train else None,
        final_loss=final, best_loss=best, best_eval_loss=best_finite(evals), loss_curve=curve,
        job_num=_job_num(tags.get(JOB_NUM_TAG)) if JOB_NUM_TAG in tags else (
            int(match.group(1)) if match and SWEEP_TAG in tags else None),
        group=tags.get(PARENT_TAG) or tags.get(SWEEP_TAG), note=note, diagnosed=diagnosed,
    )


def _expected_points(run: Any) -> int:
    """How many loss points a run should hold (its summary's steps), to pack bulk history requests."""
    steps = (_summary(run.data.tags.get(SUMMARY_TAG)) or {}).get("steps")
    return int(steps) + 1 if isinstance(steps, (int, float)) and steps >= 0 else 1000


def _summary(text: str | None) -> dict[str, Any] | None:
    """The ``trackdiag.summary`` tag, checked: ``{"steps", "health", "alerts": {kind: [n, step, sev]}}``."""
    if not text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    alerts = data.get("alerts") if isinstance(data, dict) else None
    if not isinstance(alerts, dict) or not all(isinstance(v, list) and len(v) == 3 for v in alerts.values()):
        return None
    return data


def _alerts_from_tags(tags: dict[str, str], metrics: dict[str, float]) -> tuple[dict[str, int], dict[str, int]]:
    """(count, first step) per alert kind from ``trackdiag.alert.<kind>`` tags and ``diag/alerts/<kind>``."""
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
            counts[key[len(ALERT_METRIC_PREFIX):]] = int(value)
    return {k: n for k, n in counts.items() if n > 0 or k in firsts}, firsts


def _search(client: Any, exp_ids: list[str], flt: str, page_size: int) -> Iterator[Any]:
    """Every run matching ``flt``, page by page (``page_token``) so no run is silently cut off."""
    token: str | None = None
    while True:
        page = client.search_runs(exp_ids, filter_string=flt, max_results=page_size, page_token=token)
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

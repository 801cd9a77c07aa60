"""Read runs from local records: a Hydra multirun dir, or any tree holding trackdiag run dirs.

A run dir is a directory with ``run.json`` (written by the local sink at open). A Hydra job dir
(one holding ``.hydra/``) with no run dir inside is a job that died before diagnostics started:
it is reported as ``FAILED`` with its overrides. Job statuses recorded by the Hydra callback
(``<sweep>/.trackdiag/jobs/<num>.json``) override what ``run.json`` says when the job failed.
Cost: one pass over the tree, two small JSON reads per run and one scan of ``records.jsonl``
(only lines carrying the loss are parsed). Reads are bounded and type-checked
(:mod:`trackdiag.compare.safe_read`): a malformed run dir is skipped with one warning line naming
it and the reason, never a traceback; long values are cut on reading, so time stays linear.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from trackdiag.compare.hydra_jobs import failed_job, job_num, overlay, read_job_markers, read_overrides
from trackdiag.compare.runs import (
    HEALTH_RANK,
    CompareError,
    Progress,
    RunSummary,
    best_finite,
    first_anomaly,
    flatten,
    health_from_severities,
    loss_stats,
    training_health,
)
from trackdiag.compare.safe_read import (
    UnreadableFile,
    as_dict,
    as_int,
    as_str,
    iter_json_lines,
    normalise_summary,
    read_json,
)
from trackdiag.compare.trials import read_trial_file

log = logging.getLogger(__name__)

_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


def load_local(root: str | Path, progress: Progress | None = None) -> list[RunSummary]:
    """Every run under ``root`` (a sweep dir, a single run dir, or any tree of them).

    Raises :class:`CompareError` if ``root`` is not a directory.
    """
    root = Path(root).resolve()
    if not root.is_dir():
        raise CompareError(f"{root} is not a directory (expected a Hydra multirun dir or a tree of trackdiag runs)")
    run_dirs, job_dirs, markers = _discover(root)
    owned: dict[Path, list[Path]] = {j: [] for j in job_dirs}
    for rd in run_dirs:
        job = next((p for p in rd.parents if p in owned), None)
        if job is not None:
            owned[job].append(rd)
    total = len(run_dirs) + sum(1 for runs in owned.values() if not runs)
    done = 0
    runs: list[RunSummary] = []
    job_of = {rd: j for j, rds in owned.items() for rd in rds}
    seen_jobs: set[tuple[str, int]] = set()
    for rd in run_dirs:
        try:
            run = read_run_dir(rd)
        except UnreadableFile as e:  # a malformed record: one line, never a traceback
            log.warning("trackdiag compare: skipping %s: %s", rd, e)
            continue
        except Exception as e:  # noqa: BLE001 - anything else unforeseen in a hostile dir: still one line
            log.warning("trackdiag compare: skipping %s: %s: %s", rd, type(e).__name__, str(e)[:200])
            continue
        job = job_of.get(rd)
        if job is not None:
            run.overrides = read_overrides(job)
        sweep = str(job.parent) if job is not None else run.group
        if sweep is not None and run.job_num is not None:
            seen_jobs.add((sweep, run.job_num))
            overlay(run, markers.get((sweep, run.job_num)))
        runs.append(run)
        done += 1
        if progress:
            progress(done, total)
    for job, rds in owned.items():
        if rds:
            continue
        num = job_num(job)
        key = (str(job.parent), num) if num is not None else None
        if key is None or key not in seen_jobs:  # a run dir elsewhere may belong to it (diag.output_dir)
            runs.append(failed_job(job, num, markers.get(key) if key else None))
        done += 1
        if progress:
            progress(done, total)
    return runs


def read_run_dir(path: Path) -> RunSummary:
    """One trackdiag run dir as a :class:`RunSummary` (works on live and crashed runs too).

    Raises :class:`UnreadableFile` (one line: file, field, why) for a malformed record.
    """
    meta = as_dict(read_json(path / "run.json"), "run.json")
    raw_summary = read_json(path / "summary.json")
    summary = normalise_summary(raw_summary) if raw_summary is not None else None
    counts: dict[str, int] = {}
    firsts: dict[str, int] = {}
    sevs: dict[str, str] = {}
    note = ""
    if summary is not None:
        for kind, a in summary["alerts"].items():
            counts[kind] = a["count"]
            firsts[kind] = a["first_step"] or 0
            sevs[kind] = a["severity"]
        health = summary["health"] if summary["health"] in HEALTH_RANK else health_from_severities(sevs.values())
        health = training_health(health, sevs)
    else:  # still running, or the process died before close(): alerts.jsonl is written live
        for a in iter_json_lines(path / "alerts.jsonl"):
            try:
                kind, step = as_str(a.get("kind"), "kind", "?") or "?", as_int(a.get("step", 0), "step") or 0
                sev = as_str(a.get("severity"), "severity", "warning") or "warning"
            except UnreadableFile:
                continue  # one odd alert line does not make the run unreadable
            if kind not in counts and len(counts) >= 200:
                continue
            counts[kind] = counts.get(kind, 0) + 1
            firsts[kind] = min(step, firsts.get(kind, step))
            if _SEVERITY_RANK.get(sev, 1) >= _SEVERITY_RANK.get(sevs.get(kind, "info"), 0):
                sevs[kind] = sev
        health = training_health(health_from_severities(sevs.values()), sevs)
        note = "no summary.json: still running, or the process died before trackdiag closed"
    train, evals, last_step = _scan_losses(path / "records.jsonl")
    final, best, curve = loss_stats(train)
    steps = summary["steps"] if summary else (last_step + 1 if last_step is not None else None)
    return RunSummary(
        name=as_str(meta.get("name"), "run.json: name", None) or path.name, source_id=str(path),
        status=as_str(meta.get("status"), "run.json: status", "RUNNING") or "RUNNING",
        health=health, hparams=flatten(as_dict(meta.get("hparams"), "run.json: hparams")), alert_counts=counts,
        first_steps=firsts, severities=sevs, first_anomaly=first_anomaly(firsts, sevs), steps=steps,
        final_loss=final, best_loss=best, best_eval_loss=best_finite(evals), loss_curve=curve,
        job_num=as_int(meta.get("job_num"), "run.json: job_num"), group=as_str(meta.get("group"), "run.json: group"),
        note=note, trial=read_trial_file(path),
    )


def _discover(root: Path) -> tuple[list[Path], list[Path], dict[tuple[str, int], dict[str, Any]]]:
    """(run dirs, Hydra job dirs, job markers keyed by (sweep dir, job num)), in path order."""
    run_dirs: list[Path] = []
    job_dirs: list[Path] = []
    markers: dict[tuple[str, int], dict[str, Any]] = {}
    if (root.parent / "multirun.yaml").is_file():  # root is one job of a sweep
        markers.update({(str(root.parent), n): m for n, m in read_job_markers(root.parent).items()})
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if "multirun.yaml" in filenames:
            markers.update({(str(here), n): m for n, m in read_job_markers(here).items()})
        if "run.json" in filenames:
            run_dirs.append(here)
            dirnames[:] = []
            continue
        if ".hydra" in dirnames:
            job_dirs.append(here)
        dirnames[:] = sorted((d for d in dirnames if not d.startswith(".")), key=_natural)
    return run_dirs, job_dirs, markers


def _natural(name: str) -> tuple[int, int | str]:
    """Sort key putting job dirs 2 before 10."""
    return (0, int(name)) if name.isdigit() else (1, name)


def _scan_losses(path: Path) -> tuple[list[tuple[int, float]], list[float], int | None]:
    """(train loss points, eval losses, last record step) from ``records.jsonl``; torn, over-long
    and malformed lines and points are skipped."""
    train: list[tuple[int, float]] = []
    evals: list[float] = []
    last: int | None = None
    for d in iter_json_lines(path, (b'"diag/loss"', b'"diag/eval/loss"')):
        step = _step(d.get("step"))
        if step is not None:
            last = step
        series = d.get("series")
        points = series.get("diag/loss") if isinstance(series, dict) else None
        for point in points if isinstance(points, list) else ():
            if isinstance(point, list) and len(point) == 2 and _step(point[0]) is not None \
                    and (value := _value(point[1])) is not None:
                train.append((int(point[0]), value))
        scalars = d.get("scalars")
        value = _value(scalars.get("diag/eval/loss")) if isinstance(scalars, dict) else None
        if value is not None:
            evals.append(value)
    return train, evals, last


def _value(v: Any) -> float | None:
    """A loss value: a JSON number (not a bool), or the record's ``"nan"``/``"inf"``/``"-inf"``
    text for non-finite values (a diverged loss is data); else None."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    return float(v) if isinstance(v, str) and v in _NONFINITE else None


_NONFINITE = frozenset({"nan", "inf", "-inf"})


def _step(v: Any) -> int | None:
    """A step number: an int, or an integral finite float; else None."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and math.isfinite(v) and v.is_integer():
        return int(v)
    return None

"""Read runs from local records: a Hydra multirun dir, or any tree holding trackdiag run dirs.

A run dir is a directory with ``run.json`` (written by the local sink at open). A Hydra job dir
(one holding ``.hydra/``) with no run dir inside is a job that died before diagnostics started:
it is reported as ``FAILED`` with its overrides. Job statuses recorded by the Hydra callback
(``<sweep>/.trackdiag/jobs/<num>.json``) override what ``run.json`` says when the job failed.
Cost: one pass over the tree, two small JSON reads per run and one scan of ``records.jsonl``
(only lines carrying the loss are parsed).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from trackdiag.compare.hydra_jobs import failed_job, job_num, overlay, read_job_markers, read_overrides
from trackdiag.compare.runs import (CompareError, Progress, RunSummary, best_finite, first_anomaly, flatten,
                                    health_from_severities, loads, loss_stats, read_json)

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
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a malformed record
            log.warning("trackdiag compare: skipping %s: %s", rd, e)
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
    """One trackdiag run dir as a :class:`RunSummary` (works on live and crashed runs too)."""
    meta: dict[str, Any] = read_json(path / "run.json") or {}
    summary = read_json(path / "summary.json")
    counts: dict[str, int] = {}
    firsts: dict[str, int] = {}
    sevs: dict[str, str] = {}
    note = ""
    if summary is not None:
        for kind, a in summary.get("alerts", {}).items():
            counts[kind] = int(a.get("count", 0))
            firsts[kind] = int(a.get("first_step", 0))
            sevs[kind] = str(a.get("severity", "warning"))
        health = str(summary.get("health", health_from_severities(sevs.values())))
    else:  # still running, or the process died before close(): alerts.jsonl is written live
        for a in _read_jsonl(path / "alerts.jsonl"):
            kind, step, sev = str(a.get("kind")), int(a.get("step", 0)), str(a.get("severity", "warning"))
            counts[kind] = counts.get(kind, 0) + 1
            firsts[kind] = min(step, firsts.get(kind, step))
            if _SEVERITY_RANK.get(sev, 1) >= _SEVERITY_RANK.get(sevs.get(kind, "info"), 0):
                sevs[kind] = sev
        health = health_from_severities(sevs.values())
        note = "no summary.json: still running, or the process died before trackdiag closed"
    train, evals, last_step = _scan_losses(path / "records.jsonl")
    final, best, curve = loss_stats(train)
    steps = summary.get("steps") if summary else (last_step + 1 if last_step is not None else None)
    return RunSummary(
        name=str(meta.get("name") or path.name), source_id=str(path), status=str(meta.get("status", "RUNNING")),
        health=health, hparams=flatten(meta.get("hparams") or {}), alert_counts=counts, first_steps=firsts,
        severities=sevs, first_anomaly=first_anomaly(firsts, sevs), steps=steps, final_loss=final,
        best_loss=best, best_eval_loss=best_finite(evals), loss_curve=curve, job_num=meta.get("job_num"),
        group=meta.get("group"), note=note,
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
    """(train loss points, eval losses, last record step) from ``records.jsonl``; torn lines skipped."""
    train: list[tuple[int, float]] = []
    evals: list[float] = []
    last: int | None = None
    try:
        f = open(path, encoding="utf-8")
    except OSError:
        return train, evals, last
    with f:
        for line in f:
            d = loads(line) if '"diag/loss"' in line or '"diag/eval/loss"' in line else None
            if not isinstance(d, dict):
                continue
            last = d.get("step", last)
            train.extend((int(s), float(v)) for s, v in d.get("series", {}).get("diag/loss", ()))
            if "diag/eval/loss" in d.get("scalars", {}):
                evals.append(float(d["scalars"]["diag/eval/loss"]))
    return train, evals, last


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Parsed JSON lines (torn ones skipped), or [] if missing."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    return [d for d in map(loads, lines) if isinstance(d, dict)]

"""Hydra job dirs: the status markers the callback writes, overrides, config, jobs without a record.

The callback (:mod:`trackdiag.hydra_callback`) writes ``<sweep>/.trackdiag/jobs/<num>.json`` with the
job's Hydra status (``COMPLETED`` | ``FAILED``) and error; a failed job is reported ``FAILED``
whatever its ``run.json`` says, and a Hydra job dir without a trackdiag record is a job that
died before diagnostics started (or ran with diagnostics off, if its marker says ``COMPLETED``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import yaml

from trackdiag.compare.runs import RunSummary, flatten, read_json

log = logging.getLogger(__name__)

#: Where the Hydra callback keeps per-job status markers, relative to the sweep dir.
JOBS_DIR = Path(".trackdiag") / "jobs"


def read_job_markers(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    """Job number -> marker (``{"status": "COMPLETED"|"FAILED", ...}``) written by the callback."""
    out: dict[int, dict[str, Any]] = {}
    jobs = sweep_dir / JOBS_DIR
    if jobs.is_dir():
        for f in jobs.glob("*.json"):
            marker = read_json(f)
            if marker is not None and f.stem.isdigit():
                out[int(f.stem)] = marker
    return out


def overlay(run: RunSummary, marker: dict[str, Any] | None) -> None:
    """Apply the Hydra job status the callback recorded: a failed job is FAILED whatever run.json says."""
    if not marker:
        return
    if marker.get("status") == "FAILED" and run.status != "FAILED":
        run.note = (run.note + "; " if run.note else "") + f"Hydra job failed: {marker.get('error', '')}".rstrip(": ")
        run.status = "FAILED"
    elif marker.get("status") == "COMPLETED" and run.status == "RUNNING":
        run.note = "the job completed but trackdiag was never closed (no `with diag:` / diag.close())"


def failed_job(job: Path, num: int | None, marker: dict[str, Any] | None) -> RunSummary:
    """A Hydra job dir without a trackdiag record."""
    completed = bool(marker) and marker.get("status") == "COMPLETED"
    error = (marker or {}).get("error", "")
    overrides = read_overrides(job)
    return RunSummary(
        name=",".join(overrides) or job.name, source_id=str(job), status="FINISHED" if completed else "FAILED",
        health="unknown", hparams=read_hydra_config(job), overrides=overrides, job_num=num,
        note="diagnostics disabled or not used" if completed
        else f"no trackdiag record: the job failed before diagnostics started {error}".strip(),
    )


def job_num(job: Path) -> int | None:
    """The Hydra job number: from ``.hydra/hydra.yaml``, else the dir name if it is a number."""
    try:
        with open(job / ".hydra" / "hydra.yaml", encoding="utf-8") as f:
            num = yaml.safe_load(f)["hydra"]["job"].get("num")
        if num is not None:
            return int(num)
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, AttributeError) as e:
        log.debug("no job num in %s: %s", job, e)
    return int(job.name) if job.name.isdigit() else None


def read_overrides(job: Path) -> list[str]:
    """The job's command-line overrides (``.hydra/overrides.yaml``), or []."""
    try:
        with open(job / ".hydra" / "overrides.yaml", encoding="utf-8") as f:
            return [str(o) for o in (yaml.safe_load(f) or [])]
    except (OSError, yaml.YAMLError, TypeError):
        return []


def read_hydra_config(job: Path) -> dict[str, Any]:
    """The job's composed config (``.hydra/config.yaml``) flattened; interpolations resolved if possible."""
    try:
        from omegaconf import OmegaConf

        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # e.g. ${hydra:...} resolvers outside a Hydra app
            data = OmegaConf.to_container(cfg, resolve=False)
        return flatten(data) if isinstance(data, dict) else {}
    except (OSError, yaml.YAMLError, ValueError, ImportError) as e:
        log.debug("no config in %s: %s", job, e)
        return {}

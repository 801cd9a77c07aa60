"""Hydra job dirs: the status markers the callback writes, overrides, config, jobs without a record.

The callback (:mod:`trackdiag.hydra.callback`) writes ``<sweep>/.trackdiag/jobs/<num>.json`` with the
job's Hydra status (``COMPLETED`` | ``FAILED``, or ``KILLED`` for a job whose process died before it
ended, :mod:`~trackdiag.hydra.sweep_end`) and error; a failed job is reported ``FAILED``
whatever its ``run.json`` says, and a Hydra job dir without a trackdiag record is a job that
died before diagnostics started (or ran with diagnostics off, if its marker says ``COMPLETED``).
Every file is read bounded and type-checked (:mod:`trackdiag.compare.safe_read`): a malformed
marker is ignored with one warning line, malformed Hydra files read as absent.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trackdiag.compare.runs import RunSummary, flatten
from trackdiag.compare.safe_read import UnreadableFile, as_int, clip, read_json, read_yaml

log = logging.getLogger(__name__)

#: Where the Hydra callback keeps per-job status markers, relative to the sweep dir.
JOBS_DIR = Path(".trackdiag") / "jobs"


def read_job_markers(sweep_dir: Path) -> dict[int, dict[str, Any]]:
    """Job number -> marker (``{"status": "COMPLETED"|"FAILED", ...}``) written by the callback."""
    out: dict[int, dict[str, Any]] = {}
    jobs = sweep_dir / JOBS_DIR
    if jobs.is_dir():
        for f in jobs.glob("*.json"):
            if not f.stem.isdigit():
                continue
            try:
                marker = read_json(f, limit=2**20)
            except UnreadableFile as e:
                log.warning("trackdiag compare: ignoring job marker %s: %s", f, e)
                continue
            if isinstance(marker, dict):
                out[int(f.stem)] = marker
            elif marker is not None:
                log.warning("trackdiag compare: ignoring job marker %s: expected an object, got %s", f,
                            type(marker).__name__)
    return out


def overlay(run: RunSummary, marker: dict[str, Any] | None) -> None:
    """Apply the Hydra job status the callback recorded: a failed job is FAILED whatever run.json says."""
    if not marker:
        return
    if marker.get("status") == "FAILED" and run.status != "FAILED":
        run.note = (run.note + "; " if run.note else "") + f"Hydra job failed: {_error(marker)}".rstrip(": ")
        run.status = "FAILED"
    elif marker.get("status") == "KILLED" and run.status not in ("FAILED", "KILLED"):
        run.note = f"killed: {_error(marker)}".rstrip(": ")
        run.status = "KILLED"
    elif marker.get("status") == "COMPLETED" and run.status == "RUNNING":
        run.note = "the job completed but trackdiag was never closed (no `with diag:` / diag.close())"


def failed_job(job: Path, num: int | None, marker: dict[str, Any] | None) -> RunSummary:
    """A Hydra job dir without a trackdiag record: ``FAILED`` when its marker says so, or when its
    config turned trackdiag on (it died before diagnostics started); ``no trackdiag`` when its marker
    says ``COMPLETED`` or its readable config has no enabled ``diag`` node (status ``UNKNOWN`` without a marker:
    nothing in the job dir tells how a job without trackdiag ended)."""
    status = marker.get("status") if marker else None
    error = _error(marker or {})
    overrides = read_overrides(job)
    hparams = read_hydra_config(job)
    # an unreadable or empty config tells nothing: a job dir without a record is then a job that failed
    enabled = not hparams or (any(k.startswith("diag.") for k in hparams) and hparams.get("diag.enabled") is not False)
    if status == "COMPLETED" or (status is None and not enabled):
        return RunSummary(
            name=",".join(overrides) or job.name, source_id=str(job), status="FINISHED" if status else "UNKNOWN",
            health="unknown", hparams=hparams, overrides=overrides, job_num=num, diagnosed=False,
            note="diagnostics disabled or not used" if status else "trackdiag not enabled in this job's config "
            "(no diag node, or diag.enabled=false)")
    return RunSummary(
        name=",".join(overrides) or job.name, source_id=str(job), status="KILLED" if status == "KILLED" else "FAILED",
        health="unknown", hparams=hparams, overrides=overrides, job_num=num,
        note=f"no trackdiag record: the job failed before diagnostics started {error}".strip(),
    )


def _error(marker: dict[str, Any]) -> str:
    error = marker.get("error", "")
    return clip(error if isinstance(error, str) else repr(error))


def job_num(job: Path) -> int | None:
    """The Hydra job number: from ``.hydra/hydra.yaml``, else the dir name if it is a number."""
    try:
        hydra = read_yaml(job / ".hydra" / "hydra.yaml")
        node = hydra.get("hydra") if isinstance(hydra, dict) else None
        node = node.get("job") if isinstance(node, dict) else None
        num = as_int(node.get("num"), "hydra.job.num") if isinstance(node, dict) else None
        if num is not None:
            return num
    except UnreadableFile as e:
        log.debug("no job num in %s: %s", job, e)
    return int(job.name) if job.name.isdigit() else None


def read_overrides(job: Path) -> list[str]:
    """The job's command-line overrides (``.hydra/overrides.yaml``), or [] (missing or malformed)."""
    try:
        data = read_yaml(job / ".hydra" / "overrides.yaml")
    except UnreadableFile as e:
        log.debug("no overrides in %s: %s", job, e)
        return []
    return [clip(o) for o in data if isinstance(o, str)][:1000] if isinstance(data, list) else []


def read_hydra_config(job: Path) -> dict[str, Any]:
    """The job's composed config (``.hydra/config.yaml``) flattened; interpolations resolved where
    possible (``${hydra:...}`` resolvers outside a Hydra app are kept as text)."""
    try:
        data = read_yaml(job / ".hydra" / "config.yaml")
    except UnreadableFile as e:
        log.debug("no config in %s: %s", job, e)
        return {}
    if not isinstance(data, dict):
        return {}
    try:
        from omegaconf import OmegaConf

        from trackdiag.util.sanitize import to_plain_tolerant

        data = to_plain_tolerant(OmegaConf.create(data))
    except Exception as e:  # noqa: BLE001 - omegaconf refuses the data: keep the raw values
        log.debug("unresolved config in %s: %s", job, e)
    return flatten(data) if isinstance(data, dict) else {}

"""A Hydra sweep's MLflow parent run: found, created once, merged if two appeared, ended once.

One parent run per sweep (tags ``trackdiag.role=sweep``, ``trackdiag.sweep=<sweep dir>``), each job a
child (``mlflow.parentRunId``). Jobs that start at the same moment must not make two parents:

1. the Hydra callback creates the parent in the launcher process (``on_multirun_start``), before any
   job exists, so jobs only *find* it (one ``search_runs``);
2. a job that finds none (the callback is not registered, or the server did not answer the
   launcher) creates it under an ``flock`` in the sweep dir, searching again once it holds the lock:
   jobs sharing the sweep dir's file system never make two;
3. jobs on machines that share no lock can still race; :func:`merge_parents` (run once by the
   callback when the sweep ends) keeps the earliest parent, moves the other parents' children to it
   and deletes the empty duplicates.

The parent's status is the sweep's: set once by the callback after the last job ended
(:func:`sweep_status`). Without the callback (``managed`` False), every job end sets it, sticky
FAILED/KILLED, as before. Every function here makes MLflow calls (network or database I/O) and
runs in the delivery worker, ``trackdiag sync`` or the callback, never on a training thread.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trackdiag.sinks.mlflow.store import sweep_lock

log = logging.getLogger("trackdiag")

ROLE_TAG = "trackdiag.role"      # "sweep" on a Hydra multirun's parent run
SWEEP_TAG = "trackdiag.sweep"    # the sweep dir, on the parent and on every job's run
PARENT_TAG = "mlflow.parentRunId"
STATUS_TAG = "trackdiag.status"
TERMINAL = frozenset({"FINISHED", "FAILED", "KILLED"})

_managed: set[str] = set()  # sweep dirs whose parent the Hydra callback ends (set in the job's process)


def manage(group: str) -> None:
    """Mark the sweep ``group`` (its dir) as managed by the Hydra callback in this process: its jobs'
    runs leave the parent's status to the callback's end of sweep."""
    _managed.add(str(group))


def is_managed(group: str | None) -> bool:
    """Whether the callback ends sweep ``group``'s parent run (see :func:`manage`)."""
    return group is not None and str(group) in _managed


def literal(text: str) -> str | None:
    """``text`` as an MLflow filter string literal, or None when it cannot be one. MLflow's search
    parser has no escapes (a backslash is itself): a value is quoted with the quote it does not
    contain; one holding both kinds cannot be searched for (filter on something else and compare)."""
    if "'" not in text:
        return f"'{text}'"
    return f'"{text}"' if '"' not in text else None


def parent_filter(group: str) -> str:
    """The ``search_runs`` filter for the parents of sweep ``group`` (their role alone when the sweep
    dir cannot be a literal; :func:`find_parents` compares the tag itself anyway)."""
    role = f"tags.`{ROLE_TAG}` = 'sweep'"
    value = literal(group)
    return f"{role} and tags.`{SWEEP_TAG}` = {value}" if value else role


def find_parents(client: Any, experiment_ids: list[str], group: str) -> list[Any]:
    """The live parent runs of sweep ``group``, earliest first (start time, then run id): the first
    is the canonical one. One ``search_runs`` call."""
    found = client.search_runs(experiment_ids, filter_string=parent_filter(group), max_results=1000)
    return sorted((r for r in found if r.data.tags.get(SWEEP_TAG) == group),
                  key=lambda r: (r.info.start_time or 0, r.info.run_id))


def parent_name(group: str) -> str:
    """``sweep <date>/<time>``: the parent run's name, from the sweep dir's last two parts."""
    return f"sweep {Path(group).parent.name}/{Path(group).name}".strip()


def get_or_create_parent(client: Any, experiment_id: str, group: str, tags: dict[str, str]) -> tuple[str, int]:
    """(the canonical parent run id of sweep ``group``, MLflow calls made): found by its tags, else
    created under the sweep dir's lock (searched again once the lock is held). A parent a finished
    earlier multirun into the same dir left FINISHED is set RUNNING again. 1-4 calls."""
    calls = 1
    found = find_parents(client, [experiment_id], group)
    if not found:
        with sweep_lock(Path(group)):
            calls += 1
            found = find_parents(client, [experiment_id], group)
            if not found:
                calls += 1
                run = client.create_run(experiment_id, tags={ROLE_TAG: "sweep", SWEEP_TAG: group, **tags},
                                        run_name=parent_name(group))
                return str(run.info.run_id), calls
    run = found[0]
    if run.info.status not in ("RUNNING", "FAILED", "KILLED"):
        calls += 1
        client.update_run(run.info.run_id, status="RUNNING")
    return str(run.info.run_id), calls


def children(client: Any, experiment_ids: list[str], parent_id: str) -> list[Any]:
    """Every child run of ``parent_id`` (paged: a sweep of any size)."""
    out: list[Any] = []
    token: str | None = None
    while True:
        page = client.search_runs(experiment_ids, filter_string=f"tags.`{PARENT_TAG}` = {literal(parent_id)}",
                                  max_results=1000, page_token=token)
        out += list(page)
        token = page.token
        if not token:
            return out


def merge_parents(client: Any, experiment_ids: list[str], group: str) -> str | None:
    """Keep the canonical parent of sweep ``group``; the children of any other parent are moved to it
    (their ``mlflow.parentRunId`` tag) and the other parents deleted. Returns the parent id, or None
    if the sweep has no parent. One search, plus two calls per child moved and one per duplicate."""
    parents = find_parents(client, experiment_ids, group)
    if not parents:
        return None
    keep = str(parents[0].info.run_id)
    for dup in parents[1:]:
        moved = children(client, experiment_ids, dup.info.run_id)
        for child in moved:
            client.set_tag(child.info.run_id, PARENT_TAG, keep)
        client.delete_run(dup.info.run_id)
        log.info("trackdiag: sweep %s had a second MLflow parent run %s (jobs that shared no lock); its %d "
                 "run(s) moved to %s", group, dup.info.run_id, len(moved), keep)
    return keep


def sweep_status(statuses: list[str]) -> str:
    """The sweep's status from its jobs' run statuses: FAILED if any failed, else KILLED if any was
    killed, else RUNNING if any still runs, else FINISHED."""
    for status in ("FAILED", "KILLED", "RUNNING"):
        if status in statuses:
            return status
    return "FINISHED"


def end_parent_after_job(client: Any, parent_id: str, job_status: str, end_ms: int) -> int:
    """Unmanaged sweeps (no callback): a job's end sets the parent's status, FINISHED unless a job
    failed or was killed (sticky). Returns the calls made (2)."""
    current = client.get_run(parent_id).info.status
    new = job_status if job_status != "FINISHED" else (current if current in ("FAILED", "KILLED") else "FINISHED")
    client.set_terminated(parent_id, new, end_time=end_ms)
    return 2


SUMMARY_TAG = "trackdiag.summary"   # compact run summary, read by ``trackdiag compare`` from the server


def summary_tag(summary: dict[str, Any], limit: int = 8000) -> str:
    """The run's summary as one compact JSON tag value (``{"steps", "health", "alerts": {kind: [count,
    first step, severity]}}``): a comparison read from the server gets each run's alerts from the
    ``search_runs`` page, with no extra call per run. Kinds beyond ``limit`` characters are dropped
    (rarest first) and ``"cut": true`` says so."""
    import json

    alerts = summary.get("alerts") if isinstance(summary.get("alerts"), dict) else {}
    rows = {str(k): [int(v.get("count", 0)), v.get("first_step"), str(v.get("severity", "warning"))]
            for k, v in alerts.items() if isinstance(v, dict)}
    out: dict[str, Any] = {"steps": summary.get("steps"), "health": summary.get("health"), "alerts": rows}
    text = json.dumps(out, separators=(",", ":"), default=str)
    while len(text) > limit and rows:
        rows.pop(min(rows, key=lambda k: (rows[k][0], k)))
        out["cut"] = True
        text = json.dumps(out, separators=(",", ":"), default=str)
    return text

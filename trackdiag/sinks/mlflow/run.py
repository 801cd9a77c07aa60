"""Executes groups of MLflow sink ops (see ``_mlflow_ops``, ``_mlflow_batch``) with an ``MlflowClient``.

The run state (tracking URI, run id, whether we own the run, sweep parent) lives in a plain dict
so the spool can persist it and ``trackdiag sync`` can resume delivery in another process.
Every call here is network or database I/O: this runs in the delivery worker process, on the
sink's delivery thread (``delivery: thread``) or in ``trackdiag sync``, never on the training thread.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from trackdiag.sinks.mlflow.new_store import seed
from trackdiag.sinks.mlflow.note import fill_note
from trackdiag.sinks.mlflow.ops import KeyMap
from trackdiag.sinks.mlflow.store import default_artifact_location, is_remote
from trackdiag.sinks.mlflow.sweep import (  # noqa: F401 (re-exported)
    PARENT_TAG,
    ROLE_TAG,
    STATUS_TAG,
    SWEEP_TAG,
    end_parent_after_job,
    get_or_create_parent,
)
from trackdiag.sinks.mlflow.upload import Collected, send_batches, upload

log = logging.getLogger("trackdiag")

SESSION_TAG = "trackdiag.session"   # one id per session: a run created twice by retried requests is found by it
KIND_TAG = "mlflow.experimentKind"   # the MLflow 3 UI's view: "Model training" for this value
KIND = "custom_model_development"


class NoRun(RuntimeError):
    """An op needs the run, but the run could not be set up (see the earlier warning)."""


class Runner:
    """Applies ops to one run. ``state`` keys: ``tracking_uri``, ``run_id``, ``owns_run``,
    ``parent_run_id``, ``experiment_id``, ``sweep_managed`` (the Hydra callback ends the sweep's
    parent run); ``open`` fills them in. ``calls``: MLflow calls made. ``ended``: the run's end
    was sent (see :meth:`abandon`)."""

    def __init__(self, state: dict[str, Any], *, resumed: bool = False) -> None:
        from mlflow import MlflowClient  # lazy: importing mlflow costs ~2 s

        seed(state["tracking_uri"])  # a new SQLite store: a copy of an empty one, not ~60 migrations
        self.state = state
        self.resumed = resumed  # delivering a spool another process left: it may have made the run already
        self.client = MlflowClient(tracking_uri=state["tracking_uri"])
        self.known_params: set[str] | None = None  # params already on the run (None: not read yet)
        self.keys = KeyMap()  # metric/image keys -> MLflow keys (see _mlflow_ops.sanitize_key)
        self.renderer: Any = None
        self.user_note: bool | None = None  # an attached run's own description (see _mlflow_note.fill_note)
        self.calls = 0
        self.ended = False

    def run(self, op: dict[str, Any]) -> None:
        """Execute one op (a group of one); FileNotFoundError if its file is gone."""
        refused = self.run_many([op])
        if refused:
            raise FileNotFoundError(refused[0])

    def run_many(self, ops: list[dict[str, Any]]) -> dict[int, str]:
        """Execute a group of ops with the fewest calls: params, tags and points merged into
        ``log_batch`` calls, files and images into one upload, the ``end`` op last. Returns the ops
        skipped (index -> why: a file that no longer exists). Raises whatever MLflow raises (the
        caller classifies it); nothing of a failed group counts as delivered."""
        if ops and ops[0]["op"] == "open":
            for op in ops:
                self._open(op)
            return {}
        if not self.state.get("run_id"):
            raise NoRun("the MLflow run was never created")
        got = Collected()
        end = None
        refused: dict[int, str] = {}
        for i, op in enumerate(ops):
            if op["op"] == "end":
                end = op
            elif (why := got.add(op, self.keys)) is not None:
                refused[i] = why
        if got.params and self.known_params is None:
            self.known_params = set(self._get_run(self.state["run_id"]).data.params)
        fill_note(self, got.tags)  # the run's description links its own page (ids known only here)
        self.calls += send_batches(self.client, self.state["run_id"], got, self.known_params or set())
        self.calls += upload(self, got)
        if end is not None:
            self._end(end)
        return refused

    # ------------------------------------------------------------------ run set-up
    def _open(self, op: dict[str, Any]) -> None:
        spec = op["spec"]
        if self.state.get("run_id"):  # replayed by sync after the run was made
            return
        if spec.get("attach_run_id"):
            run = self._get_run(spec["attach_run_id"])
            self.state.update(run_id=run.info.run_id, owns_run=False, parent_run_id=None,
                              experiment_id=run.info.experiment_id)
            return
        location = spec.get("artifact_location") or default_artifact_location(
            self.state["tracking_uri"], Path.cwd(), spec["experiment"])  # sync may target another store
        eid = self._experiment(spec["experiment"], location)
        parent = None
        if spec.get("group"):
            parent, calls = get_or_create_parent(self.client, eid, spec["group"], run_tags(spec.get("source")))
            self.calls += calls
        tags = {**run_tags(spec.get("source")), **(spec.get("tags") or {})}  # the run is never seen without them
        if parent:
            tags[PARENT_TAG] = parent
        session = tags.get(SESSION_TAG)
        remote = is_remote(self.state["tracking_uri"])
        made = self._session_runs(eid, session) if session and (remote or self.resumed) else []
        if made:  # an earlier try's create_run reached the store but its answer did not come back
            run, self.known_params = made[0], None
        else:
            self.calls += 1
            run = self.client.create_run(eid, start_time=spec.get("start_ms"), tags=tags, run_name=spec["run_name"])
            self.known_params = set()  # a run made here has no params yet: no get_run before the first batch
            if session and remote:
                self._drop_twins(eid, session, run.info.run_id)
        self.state.update(run_id=run.info.run_id, owns_run=True, parent_run_id=parent, experiment_id=eid,
                          sweep_managed=bool(spec.get("sweep_managed")))

    def _session_runs(self, experiment_id: str, session: str) -> list[Any]:
        """The live runs this session made in ``experiment_id``, earliest first. One call."""
        self.calls += 1
        found = self.client.search_runs([experiment_id], f"tags.`{SESSION_TAG}` = '{session}'", max_results=10)
        return sorted(found, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def _drop_twins(self, experiment_id: str, session: str, keep: str) -> None:
        """Delete the other runs one ``create_run`` made: MLflow's HTTP client retries a POST whose
        answer timed out or came back 5xx, and the first try may have created its run already (a
        slow server under a sweep's load). Those twins are empty: nothing but this call knew them."""
        for twin in self._session_runs(experiment_id, session):
            if twin.info.run_id != keep:
                self.calls += 1
                self.client.delete_run(twin.info.run_id)
                log.info("trackdiag: deleted MLflow run %s, an empty twin of %s made by a retried request",
                         twin.info.run_id, keep)

    def _experiment(self, name: str, artifact_location: str | None) -> str:
        """The experiment's id, created if needed with ``mlflow.experimentKind`` =
        ``custom_model_development`` (so the UI opens it in its model-training view); an existing
        experiment gets that tag only when it has none (a user's own tag is never overwritten)."""
        self.calls += 1
        exp = self.client.get_experiment_by_name(name)
        if exp is None:
            try:
                self.calls += 1
                return str(self.client.create_experiment(name, artifact_location=artifact_location,
                                                         tags={KIND_TAG: KIND}))
            except Exception:
                exp = self.client.get_experiment_by_name(name)  # a sibling job created it first
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise ValueError(f"MLflow experiment {name!r} is deleted: restore it (mlflow experiments restore) "
                             f"or set diag.sink.mlflow.experiment")
        if KIND_TAG not in (exp.tags or {}):
            self.calls += 1
            self.client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
        return str(exp.experiment_id)

    def _get_run(self, run_id: str) -> Any:
        self.calls += 1
        return self.client.get_run(run_id)

    def _end(self, op: dict[str, Any]) -> None:
        status, ts = op["status"], int(op.get("ts") or time.time() * 1000)
        if not self.state.get("owns_run"):
            return  # the user's run: they end it
        self.calls += 1
        self.client.set_terminated(self.state["run_id"], status, end_time=ts)
        self.ended = True
        parent = self.state.get("parent_run_id")
        if parent and not self.state.get("sweep_managed"):  # managed: the callback ends it after the last job
            self.calls += end_parent_after_job(self.client, parent, status, ts)

    def abandon(self) -> bool:
        """The training process died without ending the run (killed: SIGKILL, the OOM killer): end it
        KILLED with ``trackdiag.status``/``trackdiag.health`` saying so. Only a run we own that was
        not ended; True if it was ended here. Two calls."""
        if self.ended or not self.state.get("owns_run") or not self.state.get("run_id"):
            return False
        from mlflow.entities import RunTag

        now = int(time.time() * 1000)
        self.client.log_batch(self.state["run_id"], tags=[RunTag(STATUS_TAG, "KILLED"),
                                                           RunTag("trackdiag.health", "killed")], synchronous=True)
        self.client.set_terminated(self.state["run_id"], "KILLED", end_time=now)
        self.calls += 2
        self.ended = True
        return True


def run_tags(source: str | None) -> dict[str, str]:
    """The tags ``mlflow.start_run`` would set (user, source, git), for the user's entry script
    ``source`` rather than this process's: the worker's own ``sys.argv[0]`` would otherwise name
    ``_mlflow_worker.py`` as the run's Source. Git tags come from the script's repository."""
    tags: dict[str, str] = {}
    try:
        from mlflow.tracking.context.registry import resolve_tags

        tags = dict(resolve_tags({}))  # user and friends, like mlflow.start_run (best effort)
    except Exception:
        pass
    if source is None:
        return tags
    tags = {k: v for k, v in tags.items() if not k.startswith("mlflow.source.")}
    tags.update({"mlflow.source.name": source, "mlflow.source.type": "LOCAL"})
    try:
        from mlflow.utils.git_utils import get_git_branch, get_git_commit, get_git_repo_url

        git = {"mlflow.source.git.commit": get_git_commit(source), "mlflow.source.git.branch": get_git_branch(source),
               "mlflow.source.git.repoURL": get_git_repo_url(source)}
        tags.update({k: v for k, v in git.items() if v})
    except Exception as exc:  # gitpython missing or broken: no git tags
        log.debug("trackdiag: no git tags for %s: %s", source, exc)
    return tags

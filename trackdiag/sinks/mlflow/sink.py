"""MLflow sink: streams records, histograms, alerts and the run summary to an MLflow run.

What lands in the run (keys pass through :func:`~trackdiag.sinks.mlflow.ops.sanitize_key`):

- metrics: every point of ``Record.points()`` at its own step (series points too), in ``log_batch``
  calls (<= 1000 each); ``diag/alerts/<kind>``: running count, step-shaped over the run's whole
  step range so its chart lines up with ``diag/loss`` (``_mlflow_alerts``).
- params: the user's hyperparameters, flattened (``optimizer.lr``), values cut to 6000 chars.
- tags: ``trackdiag.level|version|run_dir|run_name|components``, ``trackdiag.alert.<kind>`` = first
  step; ``mlflow.note.content``, the run's Description (health, each alert kind with its step,
  where, message and hint, a link to ``report.html``: ``_mlflow_note``), rewritten when a new kind
  appears and at close; at close ``trackdiag.status`` (FINISHED|FAILED|KILLED) and
  ``trackdiag.health`` (ok|warning|critical, or failed|killed for a run that did not finish without
  worse alerts); ``mlflow.source.*`` name the user's entry script; sweeps: ``trackdiag.sweep``/
  ``job_num``, ``mlflow.parentRunId`` (a parent run per Hydra multirun, ``trackdiag.role=sweep``).
  New experiments carry ``mlflow.experimentKind=custom_model_development``.
- artifacts: ``config.yaml``, ``trackdiag/diag_config.yaml``, ``histograms/step_<n>.json`` + per-step
  images (as ``log_image(key, step)`` stores them), every file in ``Record.artifacts`` (path relative
  to the run dir; ``report.html`` held back until close, after the local record stamped its final
  health and status), and at close ``alerts.json``, ``summary.json``, ``tables/tables.jsonl``,
  ``trackdiag/key_map.json``. The console's last lines: the run's page, and how to serve a local store.

Cost: on the sink thread, a shallow copy of each record's scalar dict and a deque append per
batch. A delivery thread (``_mlflow_deliver``) hands groups of queued ops to a child process
(``delivery: process``) that merges them into the fewest ``log_batch`` calls and one upload, off
the training process's GIL. Outages spool to ``<output_dir>/mlflow_spool``; ``close`` waits while
delivery moves (``_mlflow_close``); what is left stays spooled for ``trackdiag sync`` or the next
session on the same store (``_mlflow_leftovers``).
"""
from __future__ import annotations

import importlib.util
import logging
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from trackdiag.core.alert import Alert
from trackdiag.core.errors import ConfigError, TrackdiagError
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo, hydra_runtime
from trackdiag.sinks.base import Sink
from trackdiag.sinks.console import DeliveryProgress, display_health, say
from trackdiag.sinks.mlflow.alerts import AlertSeries
from trackdiag.sinks.mlflow.deliver import Deliverer
from trackdiag.sinks.mlflow.leftovers import launch, output_root, stop
from trackdiag.sinks.mlflow.media import artifact_dir, file_op, histogram_ops, to_yaml
from trackdiag.sinks.mlflow.note import NOTE_TAG, closing_lines, kinds_of, run_note
from trackdiag.sinks.mlflow.ops import MAX_METRICS, flatten, pair_ops, user_params
from trackdiag.sinks.mlflow.run import SESSION_TAG, SWEEP_TAG, Runner
from trackdiag.sinks.mlflow.spool import Spool
from trackdiag.sinks.mlflow.store import (
    absolute_sqlite,
    default_artifact_location,
    default_tracking_uri,
    option_problems,
)
from trackdiag.sinks.mlflow.sweep import SUMMARY_TAG, is_managed, summary_tag
from trackdiag.sinks.mlflow.worker import ProcessRunner

log = logging.getLogger("trackdiag")


class MlflowSink(Sink):
    """Streams diagnostics to MLflow (see the module doc for every key). Options are
    ``diag.sink.mlflow.*``; ``tracking_uri`` default: ``MLFLOW_TRACKING_URI`` or
    ``sqlite:///<original cwd>/mlflow.db``; ``experiment`` default: the Hydra job name or
    ``trackdiag``. With ``attach_active_run``, a run the user started (``mlflow.start_run``) gets
    the diagnostics and is left running. ``close_timeout``: the longest close waits for delivery
    (it gives up earlier only when nothing moved for ``close_stall_timeout`` s and the store does
    not answer). ``deliver_leftovers``: deliver, in the background, the spools earlier runs left
    under this run's output root for the same store. Raises ``TrackdiagError`` if mlflow is not
    installed, ``ConfigError`` for bad options."""

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str | None = None, run_name: str | None = None,
                 tags: dict[str, str] | None = None, artifact_location: str | None = None, log_params: bool = True,
                 log_config: bool = True, attach_active_run: bool = True, histogram_images: bool = True,
                 max_histogram_images: int = 16, retry_backoff: float = 1.0, retry_max_backoff: float = 30.0,
                 close_timeout: float = 600.0, close_stall_timeout: float = 30.0, max_memory_batches: int = 64,
                 spool_dir: str | None = None, delivery: str = "process", deliver_leftovers: bool = True) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise TrackdiagError("the MLflow sink needs mlflow: pip install mlflow "
                                 "(or drop 'mlflow' from diag.sinks)")
        problems = option_problems({"retry_backoff": retry_backoff, "retry_max_backoff": retry_max_backoff,
                                    "close_timeout": close_timeout, "close_stall_timeout": close_stall_timeout,
                                    "max_memory_batches": max_memory_batches}, max_histogram_images, delivery)
        if problems:
            raise ConfigError(problems)
        hydra = hydra_runtime()  # read here: the training thread, where Hydra and mlflow's active run live
        self._cwd = hydra["cwd"] if hydra else Path.cwd()
        self.experiment = experiment or (hydra["job_name"] if hydra else None) or "trackdiag"
        self.run_name, self.tags, self.artifact_location = run_name, dict(tags or {}), artifact_location
        self.log_params, self.log_config = log_params, log_config
        self.histogram_images, self.max_histogram_images = histogram_images, max_histogram_images
        self.retry_backoff, self.retry_max_backoff = retry_backoff, retry_max_backoff
        self.close_timeout, self.max_memory_batches, self.spool_dir = close_timeout, max_memory_batches, spool_dir
        self.close_stall_timeout, self.deliver_leftovers = close_stall_timeout, deliver_leftovers
        self.close_budget = close_timeout + 60.0  # the sink hub waits this long for close()
        self._interrupted = False  # a second Ctrl-C: close() does not wait for delivery
        self.delivery = delivery
        self._leftovers: Any = None
        self.attach_run_id: str | None = None
        fluent = sys.modules.get("mlflow")  # a user with an active run has imported mlflow already
        active = fluent.active_run() if attach_active_run and fluent is not None else None
        if active is not None and tracking_uri in (None, fluent.get_tracking_uri()):
            self.attach_run_id = active.info.run_id
            tracking_uri = absolute_sqlite(fluent.get_tracking_uri(), Path.cwd())  # the user's run, as they see it
        self._explicit_uri = tracking_uri
        self.tracking_uri = absolute_sqlite(tracking_uri, self._cwd) if tracking_uri else default_tracking_uri(self._cwd)
        self._state: dict[str, Any] = {"tracking_uri": self.tracking_uri, "run_id": None}
        self._pending: list[list[Any]] = []  # [step, ts_ms, scalars, series] per record, until the next cut
        self._npoints = 0
        self._tags: list[tuple[str, str]] = []
        self._series = AlertSeries()
        self._images = histogram_images and importlib.util.find_spec("PIL") is not None  # MLflow's log_image needs it
        if histogram_images and not self._images:
            log.info("trackdiag: Pillow not installed; MLflow gets histogram data (JSON) without images")
        self._deliver: Deliverer | None = None
        self._report: dict[str, Any] | None = None  # the run's report.html op, held back until close

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, once the delivery thread has set the run up (else None)."""
        return self._state.get("run_id")

    # ------------------------------------------------------------------ Sink API
    def open(self, run: RunInfo) -> None:
        """Queue the run set-up, tags, params and config files; start the delivery thread."""
        if self.attach_run_id is None:
            self._cwd = run.original_cwd
            self.tracking_uri = absolute_sqlite(self._explicit_uri, self._cwd) if self._explicit_uri \
                else default_tracking_uri(self._cwd)
        self._run = run
        self._media = run.output_dir / "mlflow"
        spool = Spool(Path(self.spool_dir) if self.spool_dir else run.output_dir / "mlflow_spool", owner=True)
        if spool.exists():
            moved = spool.set_aside()
            log.warning("trackdiag: an earlier run left undelivered MLflow data; moved to %s (trackdiag sync %s)",
                        moved, run.output_dir)
        from trackdiag.core.version import __version__

        argv0 = sys.argv[0] if sys.argv and sys.argv[0] not in ("", "-c", "-") else None
        spec = {"experiment": self.experiment, "run_name": self.run_name or run.name,
                "artifact_location": self.artifact_location or default_artifact_location(
                    self.tracking_uri, self._cwd, self.experiment),
                "attach_run_id": self.attach_run_id, "group": run.group, "start_ms": int(run.start_time * 1000),
                "sweep_managed": is_managed(run.group),  # the Hydra callback ends the sweep's parent run
                "source": str((self._cwd / argv0).resolve()) if argv0 else None}  # the user's script
        self._state = {"tracking_uri": self.tracking_uri, "run_id": None, "spec": spec}
        leftovers = (lambda: self._start_leftovers(spool)) if self.deliver_leftovers else None
        self._deliver = Deliverer(spool, self._state, backoff=self.retry_backoff, max_backoff=self.retry_max_backoff,
                                  max_memory_ops=self.max_memory_batches, on_open=leftovers,
                                  runner_factory=self._worker if self.delivery == "process" else Runner)
        tags = {"trackdiag.level": run.level, "trackdiag.version": __version__, "trackdiag.run_dir": str(run.output_dir),
                "trackdiag.run_name": run.name, "trackdiag.components": ",".join(run.components),
                SESSION_TAG: uuid.uuid4().hex}
        if run.group:
            tags.update({SWEEP_TAG: run.group, "trackdiag.job_num": str(run.job_num)})
        # set when the run is created as well: a job killed between the run's creation and the next call to the
        # store left a sweep's child run without its job number (until its spool was delivered)
        tag_ops = list(pair_ops("tags", {**tags, **self.tags}.items()))
        spec["tags"] = dict(pair for op in tag_ops for pair in op["items"])  # keys sanitised, values cut as for the ops
        ops: list[dict[str, Any]] = [{"op": "open", "spec": spec}, *tag_ops]
        if self.log_params and run.hparams:
            ops += pair_ops("params", user_params(flatten(run.hparams), run.level).items())
        if self.log_config:
            ops.append(self._file(to_yaml(run.hparams), "config.yaml", None))
            ops.append(self._file(to_yaml(run.config), "trackdiag/diag_config.yaml", "trackdiag"))
        self._deliver.submit(ops)
        self._deliver.start()

    def write(self, record: Record) -> None:
        """Queue the record's points (O(1): key mapping and batching happen in the runner), its
        histograms (JSON file + image ops) and artifacts."""
        ts = int((record.time or time.time()) * 1000)
        self._series.saw(record)
        self._pending.append([record.step, ts, dict(record.scalars), {k: list(v) for k, v in record.series.items()}])
        self._npoints += len(record.scalars) + sum(map(len, record.series.values()))
        ops = histogram_ops(self._media, record.step, ts, record.histograms,
                            self.max_histogram_images if self._images else 0) if record.histograms else []
        if record.tables:
            with open(self._media_path("tables.jsonl"), "a", encoding="utf-8") as f:
                f.write(Record(step=record.step, tables=record.tables).to_json() + "\n")
        for path in record.artifacts:
            op = {"op": "artifact", "path": str(path), "dir": self._artifact_dir(Path(path))}
            if Path(path).resolve() == (self._run.output_dir / "report.html").resolve():
                self._report = op  # sent at close, once the local sink stamped the final health and status in
            else:
                ops.append(op)
        if ops or self._npoints >= MAX_METRICS:
            self._cut()  # points first, in order
            self._deliver.submit(ops)  # type: ignore[union-attr]

    def alert(self, alert: Alert) -> None:
        """``diag/alerts/<kind>`` running count (step-shaped, from the run's first step);
        ``trackdiag.alert.<kind>`` = first step; a new kind rewrites the run's description."""
        rows, new_first = self._series.add(alert)
        self._pending += rows
        self._npoints += len(rows)
        if new_first:
            self._tags.append((f"trackdiag.alert.{alert.kind}", str(alert.step)))
            note = run_note(self._series.worst(), None, self._series.last_step, kinds_of(self._series.alerts), None)
            self._tags.append((NOTE_TAG, note))

    def flush(self) -> None:
        """Hand buffered points and tags to the delivery thread (called when the hub queue is dry)."""
        self._cut()

    def close(self, status: str, summary: dict[str, Any]) -> None:
        """Final files and tags, end the run with ``status`` (only a run we started), then wait while
        delivery moves (at most ``close_timeout`` s, one console line and a progress bar when it
        takes a while); what is left stays spooled, the end of the run included, for ``trackdiag
        sync`` or the next session."""
        if self._deliver is None:
            return
        health = display_health({**summary, "status": status})
        report = f"{self._report['dir']}/report.html" if self._report else None
        note = run_note(health, status, summary.get("steps"), kinds_of(self._series.alerts, summary.get("alerts")), report)
        self._tags += [("trackdiag.status", status), ("trackdiag.health", health), (NOTE_TAG, note),
                       (SUMMARY_TAG, summary_tag(summary))]
        self._pending += self._series.closing_points()
        self._cut()
        ops = [self._file(self._series.alerts, "alerts.json", None), self._file(summary, "summary.json", None),
               *([self._report] if self._report else [])]
        if (self._media / "tables.jsonl").exists():
            ops.append({"op": "artifact", "path": str(self._media / "tables.jsonl"), "dir": "tables"})
        ops.append({"op": "key_map"})
        ops.append({"op": "end", "status": status, "ts": int(time.time() * 1000)})
        self._deliver.submit(ops)
        if status == "KILLED" and not self._interrupted:  # Ctrl-C or SIGTERM: what happens now, and that nothing is lost
            say("trackdiag: closing the MLflow run as KILLED (nothing is lost: a second Ctrl-C stops waiting and "
                "keeps the rest for `trackdiag sync`)")
        progress = DeliveryProgress(f"MLflow at {self.tracking_uri}")
        (left, entities), why = self._deliver.close(self.close_timeout, self.close_stall_timeout, progress)
        stop(self._leftovers)
        progress.finish("MLflow delivery stopped" if left else "delivered to MLflow")
        for line in closing_lines(self.tracking_uri, self._state, status, health) if not left else []:
            say(line)  # the run's own page, and for a local store the one command that serves it
        spool = self._deliver.spool
        if left:
            log.warning("trackdiag: %d MLflow op(s) (%d entries, the run's end among them) not delivered to %s (%s); "
                        "they are kept in %s. The next session under %s delivers them, or now: %s -m trackdiag sync %s",
                        left, entities, self.tracking_uri, why or self._deliver.broken, spool.dir,
                        output_root(self._run.output_dir, self._cwd), sys.executable, self._run.output_dir)
        elif self._deliver.broken is None:
            spool.remove_if_done()
        spool.release()

    def interrupt(self) -> None:
        """Stop waiting for delivery at once (Ctrl-C at close); the rest stays spooled."""
        self._interrupted = True
        if self._deliver is not None:
            self._deliver.interrupt()

    # ------------------------------------------------------------------ helpers
    def _worker(self, state: dict[str, Any]) -> ProcessRunner:
        """The delivery worker (the deliverer's runner factory): its pid goes to the deliverer as soon as it runs."""
        return ProcessRunner(state, on_spawn=self._deliver.spawned)

    def _start_leftovers(self, own: Spool) -> None:
        """Once the run exists: deliver spools earlier runs left for this store, in the background."""
        self._leftovers = launch(output_root(self._run.output_dir, self._cwd), self.tracking_uri, own.dir)

    def _cut(self) -> None:
        ops = [{"op": "points", "records": self._pending}] if self._pending else []
        ops += pair_ops("tags", self._tags)
        self._pending, self._npoints, self._tags = [], 0, []
        if ops and self._deliver is not None:
            self._deliver.submit(ops)

    def _media_path(self, name: str) -> Path:
        self._media.mkdir(parents=True, exist_ok=True)
        return self._media / name

    def _file(self, obj: Any, name: str, artifact_dir: str | None) -> dict[str, Any]:
        return file_op(self._media_path(Path(name).name), obj, artifact_dir)

    def _artifact_dir(self, path: Path) -> str:
        return artifact_dir(path, self._run.output_dir)


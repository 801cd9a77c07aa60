"""Weights & Biases sink: diagnostics, histograms, images and alerts in a W&B run.

Emits, on the sink thread:
  history rows: every metric point of a record (series included, at its own step) with the x-axis
    metric ``diag/step`` = the training step (``define_metric("diag/*", step_metric="diag/step")``),
    rows in step order, one ``run.log`` per distinct step;
  ``wandb.Histogram`` per ``record.histograms`` entry, ``wandb.Image`` per PNG in ``record.artifacts``
    (under ``diag/images/<file stem>``; other files go to the run's files with ``run.save``);
  per alert: ``run.alert`` (INFO/WARN/ERROR, at or above ``notify``); ``diag/alerts/<kind>``, a running
    count on ``diag/step`` over the loss's step range (:class:`~trackdiag.sinks.wandb_util.AlertSteps`);
    summary keys ``trackdiag/alerts/<kind>/count``, ``.../first_step``, ``trackdiag/health`` (ok|warning|
    critical; failed|killed for a run that did not finish without worse alerts) and ``trackdiag/status``,
    rewritten from the session summary at close;
  summaries: ``min`` of losses, ``max`` of gradient norms, beside the last value.
Config: the run's hyperparameters with secrets redacted, plus a ``trackdiag`` section.
Cost: ``wandb.init`` (~0.5-0.8 s and a ``wandb-core`` child, the first time in a process) on the
sink thread, never the training thread; then one ``run.log`` per logged step, batched per flush.
``mode="disabled"`` imports nothing, starts nothing and writes nothing.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from trackdiag.core.alert import Alert
from trackdiag.core.errors import TrackdiagError
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo
from trackdiag.sinks.base import Sink
from trackdiag.sinks.wandb_util import (
    ALERT_LEVELS,
    SECRET_WORDS,
    SEVERITY_RANK,
    AlertSteps,
    check_credentials,
    fit_histogram,
    redact,
    resolve_mode,
    summary_policy,
    sweep_group,
)

log = logging.getLogger("trackdiag")
STEP = "diag/step"


class WandbSink(Sink):
    """Streams records and alerts to a W&B run (its own, or the user's active ``wandb.run``).

    Args:
        project, entity, notes, job_type, tags: passed to ``wandb.init`` (project default:
            ``$WANDB_PROJECT``, else ``trackdiag``).
        group: W&B group; default: the Hydra sweep, so the jobs of one multirun share a group.
        name: display name; default: the trackdiag run name (Hydra job name + overrides).
        mode: ``online`` | ``offline`` | ``disabled`` | ``shared``; default ``$WANDB_MODE``, else online.
        dir: where W&B writes (``<dir>/wandb/...``); default: the run's output dir.
        attach: log into an active ``wandb.run`` if there is one (never finished by trackdiag);
            its rows ride along with the user's next ``wandb.log`` (``commit=False``).
        notify: lowest severity sent as a ``run.alert`` notification (None: no notifications).
        alert_wait_s: ``wait_duration`` of ``run.alert``: W&B drops same-title alerts within it.
        redact: key substrings whose values are hidden in the config (default key/token/secret/password).
        save_files: send non-image artifacts (reports, JSON) to the run's files.
        settings: extra ``wandb.Settings`` fields (``{"console": "off", "x_disable_stats": true}``).
    Raises:
        TrackdiagError: wandb is not installed (and mode is not disabled), or ``mode`` is unknown.
    """

    name: ClassVar[str] = "wandb"
    _started: ClassVar[set[str]] = set()  # ids of runs trackdiag started in this process

    def __init__(self, project: str | None = None, entity: str | None = None, group: str | None = None,
                 name: str | None = None, tags: list[str] | None = None, notes: str | None = None,
                 job_type: str | None = None, mode: str | None = None, dir: str | None = None,
                 attach: bool = True, notify: str | None = "info", alert_wait_s: float = 1.0,
                 redact: list[str] | None = None, save_files: bool = True,
                 settings: dict[str, Any] | None = None) -> None:
        self.mode = resolve_mode(mode)
        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise TrackdiagError("the W&B sink needs wandb: pip install 'trackdiag[wandb]'")
        if notify is not None and notify not in SEVERITY_RANK:
            raise TrackdiagError(f"diag.sink.wandb.notify: {notify!r} is not one of {', '.join(SEVERITY_RANK)} or null")
        self.init_kwargs: dict[str, Any] = {"project": project, "entity": entity, "group": group, "name": name,
                                            "tags": list(tags) if tags else None, "notes": notes, "job_type": job_type}
        self.dir, self.attach, self.notify = dir, attach, notify
        self.alert_wait_s, self.save_files = alert_wait_s, save_files
        self.secret_words = tuple(redact) if redact is not None else SECRET_WORDS
        self.settings = dict(settings or {})
        self.run: Any = None
        self.owned = False
        self._wandb: Any = None
        self._rows: dict[int, dict[str, Any]] = {}
        self._defined: set[str] = set()
        self._alerts: dict[str, dict[str, Any]] = {}
        self._series = AlertSteps()

    # ------------------------------------------------------------------ lifecycle
    def open(self, run: RunInfo) -> None:
        """Start (or attach to) the W&B run, define the step axis, log the redacted config."""
        if self.mode == "disabled":
            return
        import wandb

        self._wandb = wandb
        cfg = redact(run.hparams, self.secret_words)
        section = {"level": run.level, "run_name": run.name, "output_dir": str(run.output_dir),
                   "group": run.group, "job_num": run.job_num, "config": redact(run.config, self.secret_words)}
        active = wandb.run
        if active is not None and active.id in self._started:  # a run an earlier session left open
            log.warning("trackdiag: finishing W&B run %s left open by an earlier trackdiag session", active.id)
            active.finish(exit_code=1)
            active = None
        if self.attach and active is not None:
            self.run, self.owned = active, False
            extra = {k: v for k, v in cfg.items() if k not in active.config}
            active.config.update({**extra, "trackdiag": section}, allow_val_change=True)
        else:
            self._start(run, {**cfg, "trackdiag": section}, reinit="create_new" if active is not None else None)
        self.run.define_metric(STEP, hidden=True)
        self.run.define_metric("diag/*", step_metric=STEP)
        self.run.summary.update({"trackdiag/health": "ok", "trackdiag/level": run.level})

    def _start(self, run: RunInfo, config: dict[str, Any], reinit: str | None) -> None:
        wandb = self._wandb
        if self.mode == "online":
            check_credentials(self.settings)
        kwargs = {k: v for k, v in self.init_kwargs.items() if v is not None}
        kwargs.setdefault("name", run.name)
        if run.group is not None:
            kwargs.setdefault("group", sweep_group(run.group))
        if "project" not in kwargs and not os.environ.get("WANDB_PROJECT"):
            kwargs["project"] = "trackdiag"
        out = Path(self.dir) if self.dir else run.output_dir
        out.mkdir(parents=True, exist_ok=True)
        if reinit is not None:
            kwargs["reinit"] = reinit
        t0 = time.perf_counter()
        self.run = wandb.init(dir=str(out), mode=self.mode, config=config, settings=wandb.Settings(**self.settings),
                              **kwargs)
        log.debug("trackdiag: wandb.init (%s) took %.2fs", self.mode, time.perf_counter() - t0)
        self.owned = True
        self._started.add(self.run.id)

    def close(self, status: str, summary: dict[str, Any]) -> None:
        """Deliver buffered rows, write the alert summary (``trackdiag/status``, and
        ``trackdiag/health`` = failed|killed for a run that did not finish without worse alerts),
        finish the run if trackdiag started it (``exit_code`` 0 for FINISHED, 1 for FAILED/KILLED;
        W&B shows it as failed). ``finish`` waits for the upload (online); when that takes more
        than ~0.5 s one console line says so, with elapsed time on a terminal."""
        if self.run is None:
            return
        for step, key, count in self._series.closing():
            self._row(step)[key] = count
        self.flush()
        from trackdiag.sinks.console import DeliveryProgress, display_health

        final: dict[str, Any] = {"trackdiag/health": display_health({**summary, "status": status}),
                                 "trackdiag/status": status, "trackdiag/steps": summary.get("steps", 0)}
        for kind, a in (summary.get("alerts") or {}).items():
            final.update({f"trackdiag/alerts/{kind}/count": a.get("count", 0),
                          f"trackdiag/alerts/{kind}/first_step": a.get("first_step"),
                          f"trackdiag/alerts/{kind}/first_where": a.get("first_where", ""),
                          f"trackdiag/alerts/{kind}/suppressed": a.get("suppressed", 0)})
        overhead = summary.get("overhead") or {}
        if "fraction" in overhead:
            final["trackdiag/overhead_fraction"] = overhead["fraction"]
        self.run.summary.update(final)
        if self.owned:
            self._started.discard(self.run.id)
            progress = DeliveryProgress(f"W&B ({self.mode}), run {self.run.name}")
            with progress.ticking():
                self.run.finish(exit_code=0 if status == "FINISHED" else 1)
            progress.finish("W&B run finished")
        self.run = None

    # ------------------------------------------------------------------ data
    def write(self, record: Record) -> None:
        """Buffer the record's points, histograms and images as rows keyed by step."""
        if self.run is None:
            return
        self._series.saw(int(record.step))
        for key, step, value in record.points():
            self._define(key)
            self._series.saw(int(step))
            self._row(step)[key] = value
        for key, hist in record.histograms.items():
            fitted = fit_histogram(hist.edges, hist.counts)
            if fitted is not None:
                self._row(record.step)[key] = self._wandb.Histogram(np_histogram=fitted)
        for path in map(Path, record.artifacts):
            if not path.is_file():
                log.debug("trackdiag: W&B sink skips missing artifact %s", path)
            elif path.suffix.lower() == ".png":
                self._row(record.step)[f"diag/images/{path.stem}"] = self._wandb.Image(str(path))
            elif self.save_files:
                self.run.save(str(path), base_path=str(path.parent), policy="now")

    def alert(self, alert: Alert) -> None:
        """Notify (``run.alert``), count (``diag/alerts/<kind>``: step-shaped points) and summarise one alert."""
        if self.run is None:
            return
        a = self._alerts.setdefault(alert.kind, {"count": 0, "first_step": alert.step})
        a["count"] += 1
        a["first_step"] = min(a["first_step"], alert.step)
        for step, key, count in self._series.add(alert.kind, int(alert.step)):
            self._define(key)
            self._row(step)[key] = count
        a["severity"] = max(a.get("severity", "info"), alert.severity, key=lambda s: SEVERITY_RANK.get(s, 0))
        ranks = [SEVERITY_RANK.get(x["severity"], 0) for x in self._alerts.values()]
        health = "critical" if max(ranks) >= 2 else "warning" if max(ranks) == 1 else "ok"
        self.run.summary.update({f"trackdiag/alerts/{alert.kind}/count": a["count"],
                                 f"trackdiag/alerts/{alert.kind}/first_step": a["first_step"],
                                 "trackdiag/health": health})
        if self.notify is not None and SEVERITY_RANK.get(alert.severity, 0) >= SEVERITY_RANK[self.notify]:
            where = f" ({alert.where})" if alert.where else ""
            self.run.alert(title=f"trackdiag: {alert.kind}{where}"[:63], text=alert.describe(),
                           level=self._wandb.AlertLevel(ALERT_LEVELS.get(alert.severity, "WARN")),
                           wait_duration=self.alert_wait_s)

    def flush(self) -> None:
        """Log buffered rows in step order: one row per step for an owned run, one ``commit=False``
        row (latest values) for an attached run so the user's step counter is never advanced."""
        if self.run is None or not self._rows:
            return
        rows, self._rows = self._rows, {}
        if self.owned:
            for step in sorted(rows):
                self.run.log({**rows[step], STEP: step})
        else:
            merged: dict[str, Any] = {}
            for step in sorted(rows):
                merged.update(rows[step])
            self.run.log({**merged, STEP: max(rows)}, commit=False)

    def _row(self, step: int) -> dict[str, Any]:
        return self._rows.setdefault(int(step), {})

    def _define(self, key: str) -> None:
        """Explicit metric definitions (first sight only) for keys whose summary keeps min/max, and for
        ``diag/alerts/<kind>``: on ``diag/step`` by name, not only through the ``diag/*`` glob."""
        if key in self._defined:
            return
        self._defined.add(key)
        policy = summary_policy(key)
        if policy is not None:
            self.run.define_metric(key, step_metric=STEP, summary=policy)
        elif key.startswith("diag/alerts/"):
            self.run.define_metric(key, step_metric=STEP)

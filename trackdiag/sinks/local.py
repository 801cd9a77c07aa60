"""The local record, always on: the source of truth for ``trackdiag compare`` and plots.

Writes into the run's output dir: ``records.jsonl`` (one :class:`Record` per line),
``alerts.jsonl`` (as they happen), ``alerts.json`` and ``summary.json`` (at close), ``run.json``
(name, level, config, hyperparameters, status, sanitising notes); at close it stamps the final
health and status into ``report.html`` (drawn while the run closes, before they are known). Config and hyperparameters
arrive sanitised and redacted (:class:`~trackdiag.core.runinfo.RunInfo`). If the output dir cannot be
written at open, the record goes to a temporary dir instead (one warning saying where; the
run's ``output_dir`` is updated, so sinks opened after this one and ``summary()`` follow it).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

from trackdiag.core.alert import Alert
from trackdiag.core.record import Record
from trackdiag.core.runinfo import RunInfo, fallback_dir
from trackdiag.sinks.base import Sink


class LocalSink(Sink):
    name = "local"

    def __init__(self) -> None:
        self.dir: Path | None = None
        self._records: IO[str] | None = None
        self._alerts: IO[str] | None = None
        self._all_alerts: list[dict[str, Any]] = []
        self._meta: dict[str, Any] = {}

    def open(self, run: RunInfo) -> None:
        self._meta = {
            "name": run.name, "level": run.level, "status": "RUNNING", "start_time": run.start_time,
            "group": run.group, "job_num": run.job_num, "components": run.components,
            "config": run.config, "hparams": run.hparams,
        }
        if run.notes:
            self._meta["notes"] = list(run.notes)
        try:
            self._start(run.output_dir)
        except OSError as exc:  # unwritable after all (read-only mount, quota, a race): a temporary dir
            self.close_files()
            run.output_dir = fallback_dir(run.name, run.output_dir, f"{type(exc).__name__}: {exc}")
            self._start(run.output_dir)

    def _start(self, out: Path) -> None:
        self.dir = out
        out.mkdir(parents=True, exist_ok=True)
        self._records = open(out / "records.jsonl", "a", encoding="utf-8")
        self._alerts = open(out / "alerts.jsonl", "a", encoding="utf-8")
        self._write_json("run.json", self._meta)

    def close_files(self) -> None:
        """Close the open record files (if any); the sink writes nothing more to them."""
        for f in (self._records, self._alerts):
            if f is not None:
                f.close()
        self._records = self._alerts = None

    def write(self, record: Record) -> None:
        if self._records is not None:
            self._records.write(record.to_json() + "\n")

    def alert(self, alert: Alert) -> None:
        self._all_alerts.append(alert.to_dict())
        if self._alerts is not None:
            self._alerts.write(json.dumps(alert.to_dict()) + "\n")

    def flush(self) -> None:
        for f in (self._records, self._alerts):
            if f is not None:
                f.flush()

    def close(self, status: str, summary: dict[str, Any]) -> None:
        self.flush()
        self.close_files()
        self._write_json("alerts.json", self._all_alerts)
        self._write_json("summary.json", summary)
        self._write_json("run.json", {**self._meta, "status": status, "end_time": time.time()})
        if self.dir is not None:  # the report was drawn while closing: its first line gets the final word
            from trackdiag.plots.report import stamp_status
            from trackdiag.sinks.console import display_health

            stamp_status(self.dir, display_health({**summary, "status": status}), status)

    def _write_json(self, name: str, obj: Any) -> None:
        if self.dir is None:  # open() never ran
            return
        tmp = self.dir / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=2, default=str), encoding="utf-8")
        tmp.replace(self.dir / name)

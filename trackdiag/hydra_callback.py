"""A Hydra callback that compares the runs of a multirun when it ends.

Writes ``comparison.html`` (self-contained), ``comparison.csv`` and ``comparison.json`` into the
sweep dir, and logs them to the sweep's MLflow parent run when the MLflow sink is in use.

Registered by the presets (``+diag=basic|advanced|extreme`` add ``diag/callback: compare``), or by
hand: ``+diag/callback=compare``, or in your own config::

    hydra:
      callbacks:
        trackdiag_compare:
          _target_: trackdiag.hydra_callback.CompareCallback

Hydra does not call ``on_multirun_end`` when a job fails, and under the joblib launcher each
worker holds a pickled copy of the callback. So state goes through files in the sweep dir: every
job end writes ``<sweep>/.trackdiag/jobs/<num>.json`` (its Hydra status); a failed job also writes
``<sweep>/.trackdiag/failed``. Once a job of the sweep has failed, every later job end rewrites
the comparison from what is on disk, so the last job to end leaves a complete one. A sweep
without failures is compared once, in ``on_multirun_end``. Cost: one read of every run's
local record per write (~5 ms per run) plus ~1-2 s of plotting. Nothing here ever raises:
problems are logged (a callback exception would only become a Hydra warning anyway).

Every job end (single runs too) also closes the trackdiag sessions the job opened and left open
(no ``with``, no ``close()``), with the job's status: Hydra catches a job's exception itself and
exits with ``sys.exit(1)``, so without this a crashed job's session would close at exit as
FINISHED.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("trackdiag.compare")

STATE_DIR = ".trackdiag"


class CompareCallback(Callback):
    """Compare a Hydra multirun's runs at its end (also when some jobs failed).

    plots: embed the plots in comparison.html (needs matplotlib; ~1-2 s).
    mlflow: log the outputs to the sweep's MLflow parent run, if the MLflow sink made one.
    """

    def __init__(self, plots: bool = True, mlflow: bool = True) -> None:
        self.plots = bool(plots)
        self.mlflow = bool(mlflow)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Sessions opened from now on belong to this job (see ``on_job_end``)."""
        from trackdiag import exit_status

        exit_status.job_started()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Forget the job markers of an earlier multirun into the same sweep dir."""
        try:
            state = sweep_dir(config) / STATE_DIR
            for f in [*state.glob("jobs/*.json"), state / "failed"]:
                f.unlink(missing_ok=True)
        except Exception as e:  # never break the user's sweep
            log.warning("trackdiag compare callback: %s", e)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Close the job's open sessions; record this job's status; once any job failed, rewrite the comparison."""
        _close_sessions(job_return)
        if not _is_multirun(config):
            return
        try:
            sweep = sweep_dir(config)
            status = getattr(getattr(job_return, "status", None), "name", "UNKNOWN")
            num = OmegaConf.select(config, "hydra.job.num")
            marker: dict[str, Any] = {"status": status, "time": time.time(),
                                      "overrides": list(getattr(job_return, "overrides", None) or [])}
            if status == "FAILED":
                err = getattr(job_return, "_return_value", None)
                marker["error"] = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else ""
            jobs = sweep / STATE_DIR / "jobs"
            jobs.mkdir(parents=True, exist_ok=True)
            _write_json(jobs / f"{num}.json", marker)
            if status == "FAILED":
                (sweep / STATE_DIR / "failed").touch()
            if (sweep / STATE_DIR / "failed").exists():  # on_multirun_end will not come
                self._compare(sweep, config)
        except Exception as e:
            log.warning("trackdiag compare callback: on_job_end failed: %s", e, exc_info=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Every job succeeded: write the comparison once."""
        try:
            self._compare(sweep_dir(config), config)
        except Exception as e:
            log.warning("trackdiag compare callback: on_multirun_end failed: %s", e, exc_info=True)

    def _compare(self, sweep: Path, config: DictConfig) -> None:
        """Read every run under ``sweep`` and write the outputs there (and to MLflow)."""
        from trackdiag.compare.comparison import Comparison, write_outputs
        from trackdiag.compare.local import load_local

        runs = load_local(sweep)
        if not runs:
            log.info("trackdiag: no trackdiag runs under %s, no comparison written", sweep)
            return
        comparison = Comparison.build(str(sweep), runs)
        written = write_outputs(comparison, sweep, plots=self.plots, save_pngs=False)
        log.info("trackdiag: sweep comparison (%s) -> %s", comparison.headline, written["html"])
        for line in comparison.risk_lines:
            log.info("trackdiag:   %s", line)
        if self.mlflow:
            try:
                log_to_mlflow_parent(config, sweep, [written["html"], written["csv"]])
            except Exception as e:  # a store that does not answer: one line, not a traceback
                log.warning("trackdiag: sweep comparison not logged to MLflow (%s: %s)", type(e).__name__, e)


def sweep_dir(config: DictConfig) -> Path:
    """The absolute sweep dir (a relative ``hydra.sweep.dir`` is relative to the launch dir)."""
    path = Path(str(OmegaConf.select(config, "hydra.sweep.dir")))
    if not path.is_absolute():
        cwd = OmegaConf.select(config, "hydra.runtime.cwd", default=None) or os.getcwd()
        path = Path(str(cwd)) / path
    return path.resolve()


def _close_sessions(job_return: Any) -> None:
    """Close the sessions this job opened and left open, FAILED if the job failed."""
    try:
        from trackdiag import exit_status

        failed = getattr(getattr(job_return, "status", None), "name", "") == "FAILED"
        err = getattr(job_return, "_return_value", None) if failed else None
        status = exit_status.status_of(err) if isinstance(err, BaseException) else "FAILED" if failed else None
        n = exit_status.close_job_sessions(status or exit_status.current(), exc=err if isinstance(err, BaseException) else None)
        if n:
            log.info("trackdiag: closed %d session(s) the job left open (%s)", n, status or "job ended")
    except Exception as e:
        log.warning("trackdiag compare callback: closing the job's sessions failed: %s", e)


def mlflow_store(config: DictConfig) -> str:
    """The tracking URI the MLflow sink of this app's jobs used: ``diag.sink.mlflow.tracking_uri``,
    else ``$MLFLOW_TRACKING_URI``, else the default ``sqlite:///<original cwd>/mlflow.db``."""
    from trackdiag.sinks._mlflow_store import absolute_sqlite, default_tracking_uri

    cwd = Path(str(OmegaConf.select(config, "hydra.runtime.cwd", default=None) or os.getcwd()))
    uri = OmegaConf.select(config, "diag.sink.mlflow.tracking_uri", default=None)
    return absolute_sqlite(str(uri), cwd) if uri else default_tracking_uri(cwd)


def log_to_mlflow_parent(config: DictConfig, sweep: Path, files: list[Path]) -> bool:
    """Log ``files`` to the sweep's MLflow parent run (tags ``trackdiag.role=sweep``,
    ``trackdiag.sweep=<sweep dir>``) under ``trackdiag/``, in the store the jobs used
    (:func:`mlflow_store`, the default store included). False if MLflow is not in use; when it is
    but the comparison cannot be logged, one warning says why.
    """
    sinks = OmegaConf.select(config, "diag.sinks", default=None) or []
    uses = "mlflow" in list(sinks) or OmegaConf.select(config, "diag.sink.mlflow", default=None) is not None
    if not uses:
        return False
    uri = mlflow_store(config)
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        log.warning("trackdiag: sweep comparison not logged to MLflow: mlflow is not installed")
        return False
    client = MlflowClient(tracking_uri=str(uri))
    ids = [e.experiment_id for e in client.search_experiments()]
    group = str(sweep).replace("'", "\\'")
    flt = f"tags.`trackdiag.role` = 'sweep' and tags.`trackdiag.sweep` = '{group}'"
    parents = client.search_runs(ids, filter_string=flt, max_results=10) if ids else []
    if not parents:
        log.warning("trackdiag: sweep comparison not logged to MLflow: no parent run for sweep %s in %s (the jobs' "
                    "MLflow data may still be spooled: `trackdiag sync <job dir>` delivers it)", sweep, uri)
        return False
    for f in files:
        client.log_artifact(parents[0].info.run_id, str(f), artifact_path="trackdiag")
    log.info("trackdiag: comparison logged to MLflow parent run %s", parents[0].info.run_id)
    return True


def _is_multirun(config: DictConfig) -> bool:
    """True inside a Hydra multirun job."""
    return str(OmegaConf.select(config, "hydra.mode", default="")).endswith("MULTIRUN")


def _write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (tmp + rename): concurrent workers never read half a marker."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, default=str), encoding="utf-8")
    tmp.replace(path)

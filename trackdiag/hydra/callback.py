"""A Hydra callback that compares the runs of a multirun once every job has ended.

Writes ``comparison.html`` (self-contained), ``comparison.csv`` and ``comparison.json`` into the
sweep dir, and logs them to the sweep's MLflow parent run when the MLflow sink is in use.

Registered by the presets (``+diag=basic|advanced|extreme`` add ``diag/callback: compare``), or by
hand: ``+diag/callback=compare``, or in your own config::

    hydra:
      callbacks:
        trackdiag_compare:
          _target_: trackdiag.hydra.callback.CompareCallback

Works with every launcher: the basic one (jobs one after another in the launcher's process),
``joblib`` (parallel loky worker processes, each with a pickled copy of this callback) and
``submitit`` (``submitit_local``, SLURM: job processes the launcher may not outlive). Hydra skips
``on_multirun_end`` when a job failed, so state goes through files in the sweep dir
(:mod:`trackdiag.hydra.sweep_ledger`): the launcher records how many jobs to expect and creates
the sweep's MLflow parent run before any job starts (so parallel jobs only find it); each job
records its start and its end; whichever process sees the last job end (a job's ``on_job_end``,
or the launcher at ``on_multirun_end`` or at exit) writes the comparison once, after making every
run final (:mod:`trackdiag.hydra.sweep_end`), and ends the parent run with the sweep's status. A
job whose process died (killed) is recorded KILLED. Nothing here ever raises: problems are logged
(a callback exception would only become a Hydra warning anyway).

Every job end (single runs too) also closes the trackdiag sessions the job opened and left open
(no ``with``, no ``close()``), with the job's status: Hydra catches a job's exception itself and
exits with ``sys.exit(1)``, so without this a crashed job's session would close at exit as
FINISHED.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from trackdiag.hydra import sweep_ledger as ledger

log = logging.getLogger("trackdiag.compare")

STATE_DIR = ledger.STATE_DIR


class CompareCallback(Callback):
    """Compare a Hydra multirun's runs once every job has ended (also when some failed or were killed).

    plots: embed the plots in comparison.html (needs matplotlib; ~1-2 s).
    mlflow: create the sweep's MLflow parent run up front and log the outputs to it, if the MLflow
    sink is in use.
    """

    def __init__(self, plots: bool = True, mlflow: bool = True) -> None:
        self.plots = bool(plots)
        self.mlflow = bool(mlflow)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Launcher process: a fresh ledger (the job count, when the sweeper's grid tells it), the MLflow
        parent run, and an exit hook that compares the sweep if Hydra skips ``on_multirun_end``."""
        try:
            sweep = sweep_dir(config)
            ledger.start_sweep(sweep, ledger.expected_jobs(config))
            atexit.register(_at_launcher_exit, sweep, config, self.plots, self.mlflow, os.getpid())
        except Exception as e:  # never break the user's sweep
            log.warning("trackdiag compare callback: %s", e)
            return
        if self.mlflow:
            try:
                from trackdiag.hydra.sweep_mlflow import create_parent

                create_parent(config, sweep)
            except Exception as e:  # the jobs create it then
                log.warning("trackdiag: sweep parent run not created up front (%s: %s)", type(e).__name__, e)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Sessions opened from now on belong to this job (see ``on_job_end``); the ledger learns the
        job runs in this process, and the MLflow sink that the parent run's end is ours."""
        from trackdiag.util import exit_status

        exit_status.job_started()
        if not _is_multirun(config):
            return
        try:
            from trackdiag.sinks.mlflow.sweep import manage

            sweep = sweep_dir(config)
            ledger.job_started(sweep, int(OmegaConf.select(config, "hydra.job.num")))
            manage(str(sweep))
        except Exception as e:
            log.warning("trackdiag compare callback: on_job_start failed: %s", e)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """Close the job's open sessions; record this job's status; if it was the last, compare."""
        _close_sessions(job_return)
        if not _is_multirun(config):
            return
        try:
            sweep = sweep_dir(config)
            status = getattr(getattr(job_return, "status", None), "name", "UNKNOWN")
            num = int(OmegaConf.select(config, "hydra.job.num"))
            marker: dict[str, Any] = {"status": status, "time": time.time(),
                                      "overrides": list(getattr(job_return, "overrides", None) or [])}
            if status == "FAILED":
                err = getattr(job_return, "_return_value", None)
                marker["error"] = f"{type(err).__name__}: {err}" if isinstance(err, BaseException) else ""
            ledger.job_ended(sweep, num, marker)
            self._maybe_finish(sweep, config, "job")
        except Exception as e:
            log.warning("trackdiag compare callback: on_job_end failed: %s", e, exc_info=True)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Launcher process, every job returned: compare (unless the last job did already)."""
        try:
            sweep = sweep_dir(config)
            ledger.launcher_done(sweep, all_returned=True)
            self._maybe_finish(sweep, config, "launcher")
        except Exception as e:
            log.warning("trackdiag compare callback: on_multirun_end failed: %s", e, exc_info=True)

    def _maybe_finish(self, sweep: Path, config: DictConfig, trigger: str) -> None:
        from trackdiag.hydra.sweep_end import maybe_finish

        maybe_finish(sweep, config, plots=self.plots, mlflow=self.mlflow, trigger=trigger)


def _at_launcher_exit(sweep: Path, config: DictConfig, plots: bool, mlflow: bool, pid: int) -> None:
    """The launcher exits (after a failed job Hydra skips ``on_multirun_end``): mark it done and
    compare if no job still runs; jobs still running (submitit's launcher returns at the first
    failed result) compare when the last of them ends."""
    if os.getpid() != pid:
        return
    try:
        if ledger.read_json(ledger.state(sweep) / "launcher_done.json") is None:
            ledger.launcher_done(sweep, all_returned=False)
            from trackdiag.hydra.sweep_end import maybe_finish

            maybe_finish(sweep, config, plots=plots, mlflow=mlflow, trigger="launcher exit")
    except Exception as e:
        log.warning("trackdiag compare callback: at exit: %s", e)


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
        from trackdiag.util import exit_status

        failed = getattr(getattr(job_return, "status", None), "name", "") == "FAILED"
        err = getattr(job_return, "_return_value", None) if failed else None
        status = exit_status.status_of(err) if isinstance(err, BaseException) else "FAILED" if failed else None
        n = exit_status.close_job_sessions(status or exit_status.current(), exc=err if isinstance(err, BaseException) else None)
        if n:
            log.info("trackdiag: closed %d session(s) the job left open (%s)", n, status or "job ended")
    except Exception as e:
        log.warning("trackdiag compare callback: closing the job's sessions failed: %s", e)


def log_to_mlflow_parent(config: DictConfig, sweep: Path, files: list[Path]) -> bool:
    """Log ``files`` to the sweep's MLflow parent run (tags ``trackdiag.role=sweep``,
    ``trackdiag.sweep=<sweep dir>``; the earliest if there are several) under ``trackdiag/``, in the
    store the jobs used (:func:`~trackdiag.hydra.sweep_mlflow.mlflow_store`, the default store included). False if MLflow is not
    in use; when it is but the files cannot be logged, one warning says why. (The end of a sweep
    does this itself, :mod:`trackdiag.hydra.sweep_mlflow`; this is for logging more files.)
    """
    from trackdiag.hydra.sweep_mlflow import target

    where = target(config)
    if where is None:
        return False
    try:
        from mlflow.tracking import MlflowClient

        from trackdiag.sinks.mlflow.sweep import find_parents
    except ImportError:
        log.warning("trackdiag: sweep comparison not logged to MLflow: mlflow is not installed")
        return False
    client = MlflowClient(tracking_uri=where[0])
    ids = [e.experiment_id for e in client.search_experiments()]
    parents = find_parents(client, ids, str(sweep)) if ids else []
    if not parents:
        log.warning("trackdiag: sweep comparison not logged to MLflow: no parent run for sweep %s in %s (the jobs' "
                    "MLflow data may still be spooled: `trackdiag sync <job dir>` delivers it)", sweep, where[0])
        return False
    for f in files:
        client.log_artifact(parents[0].info.run_id, str(f), artifact_path="trackdiag")
    log.info("trackdiag: comparison logged to MLflow parent run %s", parents[0].info.run_id)
    return True


def _is_multirun(config: DictConfig) -> bool:
    """True inside a Hydra multirun job."""
    return str(OmegaConf.select(config, "hydra.mode", default="")).endswith("MULTIRUN")



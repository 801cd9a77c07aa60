"""The end of a Hydra sweep: once every job has ended, compare them once and publish it.

:func:`maybe_finish` is called at every job end and by the launcher (``on_multirun_end``, or at exit
when a failed job made Hydra skip it). Under the ledger's lock it reads where the sweep stands
(:mod:`~trackdiag.hydra.sweep_ledger`); when it is over and the last comparison did not cover
every job yet, it

1. records the jobs that died without ending (killed) as ``KILLED``;
2. with MLflow, makes every run final on the store (:func:`~trackdiag.hydra.sweep_mlflow.settle`);
3. compares the runs: from the local records when every job's record is here, else from the store
   (the jobs ran on other machines), by the sweep's parent run;
4. writes ``comparison.{html,csv,json}`` into the sweep dir and, with MLflow, logs them to the parent
   run and ends it with the sweep's status.

So the comparison is written after the last job ended, whichever process that was; a job that
ends after it (a straggler a launcher never waited for) triggers it again. Cost: ~5 ms per run
read locally (or two calls per run from a server) plus ~1-2 s of plots, in the last job's process.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from trackdiag.hydra import sweep_ledger as ledger

log = logging.getLogger("trackdiag.compare")


def maybe_finish(sweep: Path, config: DictConfig, *, plots: bool, mlflow: bool, trigger: str) -> bool:
    """Compare and publish the sweep if it is over and not yet compared in full (see the module doc).
    Returns True when this call did it."""
    with ledger.locked(sweep):
        p = ledger.progress(sweep)
        if not p.over or (p.finalized is not None and set(p.covered) <= set(p.finalized)):
            return False
        for num in p.dead:
            ledger.job_ended(sweep, num, {"status": "KILLED", "time": time.time(), "overrides": [],
                                          "error": "the job's process died before the job ended (killed)"})
        if p.dead:
            log.warning("trackdiag: sweep job(s) %s died without ending (killed)", ", ".join(map(str, p.dead)))
        t0 = time.monotonic()
        _finish(sweep, config, p, plots=plots, mlflow=mlflow)
        ledger.write_json(ledger.state(sweep) / "finalized.json",
                          {"jobs": p.covered, "dead": p.dead, "trigger": trigger, "seconds": time.monotonic() - t0,
                           **ledger.me()})
    return True


def _finish(sweep: Path, config: DictConfig, p: ledger.Progress, *, plots: bool, mlflow: bool) -> None:
    from trackdiag.compare.comparison import Comparison
    from trackdiag.compare.outputs import write_outputs
    from trackdiag.hydra import sweep_mlflow

    where = sweep_mlflow.target(config) if mlflow else None
    settled: Any = None
    if where is not None:
        try:
            settled = sweep_mlflow.settle(where[0], where[1], sweep, p.dead)
        except Exception as e:  # a store that does not answer: one line, the local comparison still comes
            log.warning("trackdiag: sweep not settled in MLflow (%s: %s)", type(e).__name__, e)
    runs = _runs(sweep, p, settled, where)
    if not runs:
        log.info("trackdiag: no trackdiag runs under %s, no comparison written", sweep)
        return
    comparison = Comparison.build(str(sweep), runs)
    written = write_outputs(comparison, sweep, plots=plots, save_pngs=False)
    log.info("trackdiag: sweep comparison (%s) -> %s", comparison.headline, written["html"])
    for line in comparison.risk_lines:
        log.info("trackdiag:   %s", line)
    if comparison.has_trials:
        log.info("trackdiag: %s", comparison.stop_line)
    if settled is not None:
        client, parent, statuses = settled
        try:
            sweep_mlflow.publish(client, parent, statuses, [written["html"], written["csv"], written["json"]],
                                 comparison.stops if comparison.has_trials else None)
        except Exception as e:
            log.warning("trackdiag: sweep comparison not logged to MLflow (%s: %s)", type(e).__name__, e)


def _runs(sweep: Path, p: ledger.Progress, settled: Any, where: tuple[str, str] | None) -> list[Any]:
    """The sweep's runs: local records, unless some job's record is not here (it ran on another
    machine) and the store has the sweep's parent run."""
    from trackdiag.compare.local import load_local

    runs = load_local(sweep)
    missing = set(p.covered) - {r.job_num for r in runs}
    if not missing or settled is None or where is None:
        return runs
    from trackdiag.compare.mlflow_source import load_mlflow

    log.info("trackdiag: %d job record(s) of the sweep are not on this machine; comparing from MLflow", len(missing))
    remote = load_mlflow("", tracking_uri=where[0], parent=settled[1])
    markers = {n: m for n, m in p.ended.items()}
    from trackdiag.compare.hydra_jobs import overlay

    for run in remote:
        if run.job_num is not None:
            overlay(run, markers.get(run.job_num))
    return remote

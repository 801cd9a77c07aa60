"""``trackdiag compare optuna:<storage-url>#<study>``: an Optuna study's trials next to their runs' health.

Each trial is one row: its parameters and value (``state``, ``value``) from the study, and, when the
trial's user attribute ``trackdiag.run_dir`` (set by :mod:`trackdiag.integrations.optuna` when a
session joins the trial) names a run dir readable here, that run's health, alerts and losses from its
local record. A stopped trial shows the alert that stopped it, the step, and the steps and seconds it
saved (``trackdiag.stop.*``). A trial without a readable record is a row of its own (health ``no
trackdiag`` when it never ran trackdiag). Costs: ``import optuna``, one storage read of the study, one
local-record read per trial.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trackdiag.compare.local import read_run_dir
from trackdiag.compare.runs import CompareError, Progress, RunSummary
from trackdiag.compare.safe_read import UnreadableFile
from trackdiag.compare.trials import trial_info

log = logging.getLogger(__name__)

#: an Optuna trial state -> the run status the table shows when no record says otherwise
_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "PRUNED", "FAIL": "FAILED", "RUNNING": "RUNNING", "WAITING": "RUNNING"}
RUN_DIR_ATTR = "trackdiag.run_dir"  # the name integrations/optuna.py sets (a lower stage may not import it)


def split_spec(spec: str) -> tuple[str, str | None]:
    """``<storage-url>#<study>`` -> (url, study or None)."""
    url, sep, study = spec.rpartition("#")
    return (url, study or None) if sep else (spec, None)


def load_optuna(spec: str, progress: Progress | None = None) -> list[RunSummary]:
    """The trials of the study ``spec`` names (see the module doc); :class:`CompareError` with what to
    do when Optuna is missing, the storage cannot be opened or the study is not in it."""
    try:
        import optuna
    except ImportError:
        raise CompareError("optuna: sources need Optuna: pip install 'trackdiag[optuna]'") from None
    url, name = split_spec(spec)
    if not url:
        raise CompareError("optuna: give the study's storage URL and name: optuna:<storage-url>#<study>")
    try:
        names = optuna.get_all_study_names(storage=url)
    except Exception as exc:
        raise CompareError(f"optuna: cannot open the storage {url!r}: {type(exc).__name__}: {str(exc)[:200]}") from None
    if name is None and len(names) == 1:
        name = names[0]
    if name not in names:
        raise CompareError(f"optuna: no study {name!r} in {url}; studies there: {', '.join(names) or 'none'} "
                           "(name one: optuna:<storage-url>#<study>)")
    trials = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    runs = []
    for i, t in enumerate(trials):
        runs.append(_trial_run(t, name))
        if progress:
            progress(i + 1, len(trials))
    return runs


def _trial_run(t: Any, study: str) -> RunSummary:
    """One trial as a :class:`RunSummary`: its run's record when readable, the trial alone otherwise."""
    attrs = dict(t.user_attrs)
    stop = {k[len("trackdiag.stop."):]: v for k, v in attrs.items() if k.startswith("trackdiag.stop.")}
    info = trial_info(t.number, t.state.name, t.value if t.values and len(t.values) == 1 else None,
                      stop if attrs.get("trackdiag.stopped") else None, stop.get("reason"))
    run_dir = attrs.get(RUN_DIR_ATTR)
    run: RunSummary | None = None
    note = ""
    if isinstance(run_dir, str) and (Path(run_dir) / "run.json").is_file():
        try:
            run = read_run_dir(Path(run_dir))
        except UnreadableFile as exc:
            note = f"run record {run_dir}: {exc}"
    elif isinstance(run_dir, str):
        note = f"run record {run_dir} is not on this machine"
    if run is None:
        run = RunSummary(name=f"{study} trial {t.number}", source_id=f"{study}#{t.number}",
                         status=_STATUS.get(t.state.name, "UNKNOWN"), health="unknown", note=note,
                         diagnosed=isinstance(run_dir, str))
    run.label = f"trial {t.number}"
    run.job_num = t.number
    run.hparams.update({str(k): v for k, v in t.params.items()})
    run.trial = info
    return run

"""A Hydra job that is an Optuna trial stops itself on trackdiag's alerts (``diag.sweep.stop_on``).

The sweeper plugin ``hydra/sweeper=trackdiag_optuna`` (``hydra_plugins/trackdiag_optuna``) asks an Optuna
study for each trial and hands the job two environment variables: :data:`ENV_TRIAL` (the trial's id in
the study's storage) and :data:`ENV_STUDY` (a JSON file in the sweep dir with the storage URL and the
study's name). When a session opens with ``diag.sweep.stop_on`` set (severities and/or alert kinds) and
those variables present, :func:`sweep_watcher` loads the study, rebuilds the trial
(``optuna.trial.Trial(study, trial_id)``) and lets a :class:`~trackdiag.integrations.optuna.TrialStopper`
watch the session: the first matching alert sets ``should_stop`` (``step()`` returns True), writes the
alert into the trial's user attributes and the run's ``trial.json``; the sweeper then tells the study
PRUNED (``diag.sweep.on_stop=prune``) or FAIL (``fail``) instead of the job's return value.

Off unless asked: ``stop_on: null`` (the presets' default) does nothing, and costs nothing.
Costs when on: ``import optuna`` and one storage read at the session's open (~0.5 s), then what the
stopper costs (a look at the alert list per step, the loss reported at logging steps).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from trackdiag.core import watchers
from trackdiag.integrations.optuna import TrialStopper

log = logging.getLogger("trackdiag")

#: the trial's id in the study's storage (set per job by the sweeper, through ``hydra.job.env_set``)
ENV_TRIAL = "TRACKDIAG_OPTUNA_TRIAL"
#: a JSON file ``{"storage": URL, "study_name": NAME}`` written by the sweeper into the sweep dir
ENV_STUDY = "TRACKDIAG_OPTUNA_STUDY"
#: user attribute the job sets so the sweeper knows how to tell a stopped trial (``prune`` | ``fail``)
ON_STOP_ATTR = "trackdiag.on_stop"


def current_trial() -> Any:
    """The Optuna trial this process runs as (None outside a ``trackdiag_optuna`` sweep's job).

    Costs: ``import optuna``, one read of the study file and of the storage (the trial's params)."""
    trial_id, study_file = os.environ.get(ENV_TRIAL), os.environ.get(ENV_STUDY)
    if not trial_id or not study_file:
        return None
    import optuna

    with open(study_file, encoding="utf-8") as f:
        doc = json.load(f)
    study = optuna.load_study(study_name=doc["study_name"], storage=doc["storage"])
    return optuna.trial.Trial(study, int(trial_id))


def sweep_watcher(session: Any) -> None:
    """Called for every session that opens (:mod:`trackdiag.core.watchers`): when its config's
    ``sweep.stop_on`` is set and this job is an Optuna trial, a :class:`TrialStopper` watches it.
    Emits: a warning when ``stop_on`` is set outside a ``trackdiag_optuna`` sweep; nothing otherwise."""
    sweep = (getattr(session, "config", None) or {}).get("sweep") or {}
    stop_on = sweep.get("stop_on")
    if not stop_on:
        return
    try:
        trial = current_trial()
    except Exception as exc:  # a storage that cannot be reached must not stop the training
        log.warning("trackdiag: diag.sweep.stop_on is set but the Optuna trial could not be loaded "
                    "(%s: %s); this run will not stop on alerts", type(exc).__name__, exc)
        return
    if trial is None:
        log.warning("trackdiag: diag.sweep.stop_on=%s is set but this job is no Optuna trial (run the sweep "
                    "with hydra/sweeper=trackdiag_optuna); nothing will stop it", stop_on)
        return
    on_stop = sweep.get("on_stop") or "prune"
    trial.set_user_attr(ON_STOP_ATTR, on_stop)
    stopper = TrialStopper(trial, stop_on, on_stop=on_stop, planned_steps=sweep.get("planned_steps"))
    stopper.watch(session)


def install() -> None:
    """Register :func:`sweep_watcher` once per process (the package's face calls it at import)."""
    watchers.unwatch(sweep_watcher)
    watchers.watch(sweep_watcher)

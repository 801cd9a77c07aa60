"""Make a run that a framework created through ``MlflowClient`` the active fluent run, so that the
MLflow sink (``attach_active_run``) writes into it instead of starting a second run.

Lightning's ``MLFlowLogger`` creates its run with ``MlflowClient.create_run`` (no fluent run) and
has already pointed the fluent tracking URI at its store (``mlflow.set_tracking_uri``). The sink
reads ``mlflow.active_run()`` when it is built, so the run only has to be active around the
session's construction; it is kept on the fluent stack until training ends, then popped with the
same status the framework gives it (``mlflow.end_run(status)``: the logger's own ``finalize``
writes that status again right after).

``mlflow.start_run(run_id=...)`` refuses a run outside the active experiment (``set_experiment``,
which also sets ``MLFLOW_EXPERIMENT_ID``): then the run's experiment is made active for the call
and the previous one restored right after.

Cost: a ``get_run`` and an ``update_run_info`` on the store at start (plus two ``set_experiment``
when the active experiment differs), one ``set_terminated`` at the end.
"""
from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("trackdiag")


class FluentRun:
    """The framework's run ``run_id`` on ``tracking_uri``, made active by :meth:`enter`."""

    def __init__(self, run_id: str, tracking_uri: str | None) -> None:
        self.run_id, self.tracking_uri = run_id, tracking_uri
        self.started = False

    def enter(self) -> bool:
        """Make the run the active fluent run (nested over a different active run, if any).
        True when the run is active afterwards; False (with a warning) when MLflow refused."""
        import mlflow

        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            return True  # the user made it active already: theirs to end
        try:
            if self.tracking_uri and mlflow.get_tracking_uri() != self.tracking_uri:
                mlflow.set_tracking_uri(self.tracking_uri)  # what the logger itself does on first use
            self._start(mlflow, nested=active is not None)
        except Exception as exc:  # noqa: BLE001 - a store error must not stop training
            log.warning("trackdiag: could not join the MLflow run %s (%s: %s); diagnostics go to a run of their "
                        "own", self.run_id, type(exc).__name__, exc)
            return False
        self.started = True
        return True

    def _start(self, mlflow: Any, nested: bool) -> None:
        """``start_run(run_id)``; retried inside the run's experiment when MLflow refuses it because
        another experiment is active, which is restored afterwards."""
        try:
            mlflow.start_run(run_id=self.run_id, nested=nested)
            return
        except mlflow.exceptions.MlflowException as exc:
            log.debug("trackdiag: start_run(run_id=%s) refused (%s); retrying in its experiment", self.run_id, exc)
        previous = os.environ.get("MLFLOW_EXPERIMENT_ID")  # set by mlflow.set_experiment
        experiment = mlflow.MlflowClient().get_run(self.run_id).info.experiment_id
        mlflow.set_experiment(experiment_id=experiment)
        try:
            mlflow.start_run(run_id=self.run_id, nested=nested)
        finally:
            if previous and previous != experiment:
                try:
                    mlflow.set_experiment(experiment_id=previous)
                except Exception as err:  # noqa: BLE001 - an id left over from another store
                    log.debug("trackdiag: active MLflow experiment %s not restored (%s); %s stays active",
                              previous, err, experiment)

    def leave(self, status: str) -> None:
        """Pop the run from the fluent stack with ``status`` (only a run :meth:`enter` started)."""
        if not self.started:
            return
        self.started = False
        import mlflow

        active: Any = mlflow.active_run()
        if active is None or active.info.run_id != self.run_id:
            log.debug("trackdiag: MLflow run %s is no longer the active run; left as it is", self.run_id)
            return
        try:
            mlflow.end_run(status)
        except Exception as exc:  # noqa: BLE001
            log.warning("trackdiag: ending the fluent MLflow run failed (%s: %s)", type(exc).__name__, exc)

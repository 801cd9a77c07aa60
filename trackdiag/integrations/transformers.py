"""trackdiag as a Hugging Face ``Trainer`` callback (transformers 4.49 to 5.x)::

    from trackdiag.integrations.transformers import DiagnosticsCallback
    diag = DiagnosticsCallback(level="advanced")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[diag]).train()

Hooks used, and what each costs:
  ``on_train_begin``: builds the :class:`~trackdiag.Diagnostics` session from the ``model`` and
    ``optimizer`` the callback receives (accelerate's ``AcceleratedOptimizer``; its ``GradScaler``
    under fp16 is found inside it; an optimizer handed as None is adopted at its first step).
    Steps are numbered like ``state.global_step`` while the step runs (0 for the first, the
    checkpoint's count on resume); the Trainer stamps its own logs after counting the step, so its
    ``loss`` at logged step ``k`` is ``diag/loss`` at step ``k - 1``. With ``report_to`` MLflow /
    W&B the session writes into that run.
  gradients: no hook. The Trainer clips inside its loop, before ``on_pre_optimizer_step``; the
    session's gradient tap measures each backward pass as it ends, before clipping and unscaling,
    so ``diag/grad/global_norm`` equals the Trainer's pre-clip ``grad_norm``.
  the loss: the ``loss`` field of the model's output of each training micro-batch, combined per
    optimizer step as the Trainer combines it (see :mod:`trackdiag.integrations._step_loss`): the
    value the Trainer logs as ``loss``, except that a NaN stays a NaN (the Trainer's
    ``logging_nan_inf_filter`` logs it as an average of earlier losses, and trains on), so
    ``nonfinite_loss`` fires at the exact step and the NaN replay names the module.
  ``on_step_end`` (after the optimizer step, the scheduler and ``zero_grad``): ``diag.step()`` once
    per optimizer step (``gradient_accumulation_steps`` micro-batches), with the last micro-batch's
    inputs as ``batch``. A stop action sets ``control.should_training_stop``.
  ``on_evaluate``: ``eval_loss`` and the other ``eval_*`` metrics (not runtimes) go to ``log_eval``.
  ``on_train_end``: the session is closed FINISHED. The Trainer has no exception event: a session
    still open when the interpreter exits is closed FAILED if the script died of an exception
    (``sys.last_value``), and so is the Trainer's MLflow run it joined; else FINISHED.
    ``callback.close("FAILED")`` says it explicitly.

Runs: the Trainer's ``MLflowCallback`` starts a fluent MLflow run in its ``on_train_begin`` (before
this callback's), which the MLflow sink joins; ``WandbCallback`` runs are ``wandb.run``, which the
W&B sink joins. The run's hyperparameters are the Trainer's (the session keeps its own copy in the
local record). The sinks of a joined tracker replace the preset's own tracker.
"""
from __future__ import annotations

import atexit
import logging
import sys
from typing import Any

from trackdiag.capture.user_loss import checked
from trackdiag.core.alert import Alert
from trackdiag.integrations._common import build_session, check_config, eval_metrics, join_trackers, start_at
from trackdiag.integrations._step_loss import StepLoss
from trackdiag.session.diagnostics import Diagnostics
from trackdiag.session.disabled import DisabledDiagnostics

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("trackdiag.integrations.transformers needs transformers: "
                      "pip install 'trackdiag[transformers]'") from exc

log = logging.getLogger("trackdiag")

#: evaluation metrics that are timings, not results
EVAL_SKIP = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_model_preparation_time")


def reporting_to(args: Any) -> set[str]:
    """The integrations ``TrainingArguments.report_to`` names (``"all"``: MLflow and W&B if installed)."""
    report = args.report_to
    names = {report} if isinstance(report, str) else set(report or [])
    if "all" in names:
        from transformers.integrations import is_mlflow_available, is_wandb_available

        names |= {n for n, ok in (("mlflow", is_mlflow_available()), ("wandb", is_wandb_available())) if ok}
    return names


class DiagnosticsCallback(TrainerCallback):
    """trackdiag diagnostics for ``transformers.Trainer`` (see the module docstring).

    Args:
        level: preset (``basic`` | ``advanced`` | ``extreme``).
        join_run: write into the run of the Trainer's MLflow / W&B integration (``report_to``).
        hparams: logged with the session (default: ``TrainingArguments.to_sanitized_dict()``).
        loss_fn: ``loss_fn(batch) -> loss`` for the probes that re-evaluate the loss (landscape,
            pre-flight, NaN replay); for a model that computes its loss from ``labels`` in the batch:
            ``loss_fn=lambda batch: model(**batch)`` (the output's ``.loss`` is used).
        **overrides: preset keys for :class:`~trackdiag.Diagnostics` (``every=5``, ``sinks=[...]``,
            ``rules={"nonfinite_loss": {"action": "stop"}}``, ``output_dir=...``).
    Raises:
        ConfigError: the level or an override is invalid (at construction, before training).
    """

    def __init__(self, level: str = "advanced", *, join_run: bool = True, hparams: Any = None, loss_fn: Any = None,
                 **overrides: Any) -> None:
        check_config(level, overrides)
        self.level, self.join_run, self.hparams, self.overrides = level, join_run, hparams, dict(overrides)
        self.loss_fn = checked(loss_fn)
        self.diag: Diagnostics | DisabledDiagnostics | None = None
        self._loss: StepLoss | None = None
        self._open = False
        self._world = 1
        self._mlflow_run: str | None = None  # the Trainer's MLflow run, when joined

    # ------------------------------------------------------------------ results
    @property
    def alerts(self) -> list[Alert]:
        """Every alert of the current (or last) training run."""
        return self.diag.alerts if self.diag is not None else []

    def summary(self) -> dict[str, Any]:
        """The session's summary (alerts per kind, steps, health, overhead)."""
        return (self.diag or DisabledDiagnostics()).summary()

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        self.close("FINISHED")  # a session an earlier train() left open
        if model is None:
            log.warning("trackdiag: the Trainer passed no model to callbacks; diagnostics are off")
            return
        joined = self._join(args, state) if self.join_run else []
        hparams = self.hparams if self.hparams is not None else args.to_sanitized_dict()
        self.diag = build_session(model, optimizer, None, self.level, join_trackers(self.overrides, joined), hparams,
                                  self.loss_fn)
        start_at(self.diag, state.global_step)  # a resumed run continues the Trainer's count
        self._world = int(args.world_size) if getattr(args, "average_tokens_across_devices", False) else 1
        if self.diag.enabled:
            self._loss = StepLoss(model)
            self._open = True
            self.diag.__enter__()  # opens the sinks now, and registers the session's own exit handler
            atexit.register(self._at_exit)  # after it: runs first at exit (LIFO), with the right status

    def _join(self, args: Any, state: Any) -> list[str]:
        """The Trainer integrations' runs that are open now (rank 0 only: other ranks write nothing)."""
        if not state.is_world_process_zero:
            return []
        names, joined = reporting_to(args), []
        mlflow = sys.modules.get("mlflow")
        if "mlflow" in names and mlflow is not None and mlflow.active_run() is not None:
            joined.append("mlflow")
            self._mlflow_run = mlflow.active_run().info.run_id
        wandb = sys.modules.get("wandb")
        if "wandb" in names and wandb is not None and getattr(wandb, "run", None) is not None:
            joined.append("wandb")
        for name in sorted(names & {"mlflow", "wandb"} - set(joined)):
            log.warning("trackdiag: report_to has %r but its run is not open when training starts; diagnostics go "
                        "to the configured sinks", name)
        return joined

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._open or self._loss is None or self.diag is None:
            return
        loss, batch, size = self._loss.take(self._world)
        if self.diag.step(loss, batch=batch, batch_size=size):
            control.should_training_stop = True

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None,
                    **kwargs: Any) -> None:
        if not self._open or self.diag is None or not metrics:
            return
        loss, values = eval_metrics(metrics, "eval_loss", ("eval_",), skip=EVAL_SKIP)
        if loss is not None or values:
            self.diag.log_eval(loss=loss, **values)
        if self.diag.should_stop:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close("FINISHED")

    # ------------------------------------------------------------------ end
    def close(self, status: str = "FINISHED") -> None:
        """Close the session (``FINISHED`` | ``FAILED`` | ``KILLED``) and stop watching the model.
        Idempotent; called by ``on_train_end``."""
        if self._loss is not None:
            self._loss.close()
            self._loss = None
        if self._open and self.diag is not None:
            self._open = False
            atexit.unregister(self._at_exit)
            self.diag.close(status)

    def _at_exit(self) -> None:
        """Interpreter exit with the session open: ``train()`` never reached ``on_train_end``. After an
        uncaught exception, the Trainer's MLflow run (still active: its ``MLflowCallback`` ends runs only
        in ``on_train_end``, else MLflow's exit handler would mark it FINISHED) is ended FAILED too."""
        failed = getattr(sys, "last_value", None) is not None
        self.close("FAILED" if failed else "FINISHED")
        mlflow = sys.modules.get("mlflow")
        if failed and self._mlflow_run is not None and mlflow is not None:
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self._mlflow_run:
                mlflow.end_run("FAILED")

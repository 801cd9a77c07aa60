"""trackdiag as a Lightning 2.x callback (``import lightning.pytorch as pl``)::

    from trackdiag.integrations.lightning import DiagnosticsCallback
    diag = DiagnosticsCallback(level="advanced")
    pl.Trainer(callbacks=[diag], ...).fit(model, data)

Hooks used, and what each costs:
  ``on_fit_start``: builds the :class:`~trackdiag.Diagnostics` session from the LightningModule,
    ``trainer.optimizers`` and the precision plugin's ``GradScaler`` (``precision="16-mixed"``),
    numbered from ``trainer.global_step`` (or restored from the checkpoint's callback state). With
    an ``MLFlowLogger`` or ``WandbLogger`` the session writes into the logger's run (see below).
  gradients: no hook. The session's gradient tap measures each backward pass as it ends, before
    AMP unscaling and Lightning's own clipping (the norm is divided by the scaler's scale), so
    ``diag/grad/global_norm`` is the pre-clip ``clip_grad_norm_`` value; optimizers are followed
    through torch's global step hooks, including Lightning's ``optimizer.step(closure)``.
  ``on_train_batch_end``: the step's loss from the step's outputs (``outputs["loss"]`` or the
    returned tensor; under automatic optimization Lightning divides it by
    ``accumulate_grad_batches``, which is multiplied back: one device op). ``diag.step()`` runs once
    per real optimizer step, i.e. when ``trainer.global_step`` moved; the micro-batches of an
    accumulated step give the mean of their losses and the last micro-batch is the ``batch``. A
    ``training_step`` that returns ``{"loss": ..., "logits": out}`` (or ``outputs``/``preds``/``y_hat``)
    also feeds the output-diversity checks. A stop action sets ``trainer.should_stop``.
  ``on_validation_end`` (not during the sanity check): ``trainer.callback_metrics[monitor]`` and the
    other ``val*`` metrics go to ``log_eval`` (one host read per metric); the stop decision is then
    reduced across ranks (``strategy.reduce_boolean_decision``: one collective per validation).
  ``on_fit_end`` / ``on_exception``: the session is closed FINISHED / FAILED (KILLED for Ctrl-C).
  ``state_dict`` / ``load_state_dict``: the session's counters and EMAs ride in Lightning checkpoints.

Runs: Lightning's ``MLFlowLogger`` creates its run through ``MlflowClient`` (no fluent run): it is
made the active fluent run on rank 0 while the session is built, so the MLflow sink joins it, and
popped with the run's final status at the end. ``WandbLogger`` runs are ``wandb.run``, which the
W&B sink joins. The sinks of a joined tracker replace the preset's own tracker; with no such
logger, the configured sinks are used. Under DDP every rank computes, rank 0 writes, and rules
judge the same cross-rank record, so a stop is taken by every rank at the same step.

Limits: the NaN replay re-runs the LightningModule's own forward calls (a ``training_step`` that
calls ``self(x)``); one that only calls sub-modules is replayed as ``module(<batch input>)``.
Manual optimization with several ``opt.step()`` per batch gives one diagnostics step per batch
(``trainer.global_step`` counts optimizer steps); several optimizers make one component, each
optimizer's parameters read as its own step found them (a GAN's G after G's backward, D after D's): for
per-network statistics of a GAN, use ``trackdiag.Diagnostics`` with named components inside the
LightningModule instead. Under
``strategy="ddp_spawn"`` the sessions live in the spawned processes: ``.alerts`` of the launching
process's callback stay empty.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Mapping, Sequence

from trackdiag.capture.components import batch_size_of
from trackdiag.capture.user_loss import checked
from trackdiag.core.alert import Alert
from trackdiag.integrations._common import (
    build_session,
    check_config,
    combine_losses,
    eval_metrics,
    join_trackers,
    start_at,
    status_of,
)
from trackdiag.integrations._mlflow_join import FluentRun
from trackdiag.session.diagnostics import Diagnostics
from trackdiag.session.disabled import DisabledDiagnostics
from trackdiag.util import exit_status
from trackdiag.util.ranks import is_main_process

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("trackdiag.integrations.lightning needs Lightning 2.x: pip install 'trackdiag[lightning]'") from exc

log = logging.getLogger("trackdiag")

#: keys of a ``training_step`` dict that hold the model's outputs (for the output-diversity checks)
OUTPUT_KEYS = ("outputs", "logits", "preds", "y_hat")
#: prefixes of validation metric names (``val_acc`` is logged as ``diag/eval/acc``)
VAL_PREFIXES = ("val_", "val/", "val.", "validation_", "validation/")


def split_outputs(outputs: Any) -> tuple[Any, Any]:
    """``(loss, model outputs)`` from what ``on_train_batch_end`` receives (host work only)."""
    if isinstance(outputs, Mapping):
        return outputs.get("loss"), next((outputs[k] for k in OUTPUT_KEYS if outputs.get(k) is not None), None)
    if hasattr(outputs, "detach"):
        return outputs, None
    return None, None


class DiagnosticsCallback(pl.Callback):
    """trackdiag diagnostics for ``lightning.pytorch.Trainer`` (see the module docstring).

    Args:
        level: preset (``basic`` | ``advanced`` | ``extreme``).
        monitor: the logged validation loss (``self.log("val_loss", ...)``) sent as ``diag/eval/loss``.
        eval_keys: other ``callback_metrics`` to send to ``log_eval``; default every ``val*`` metric.
        join_loggers: write into the run of the Trainer's ``MLFlowLogger`` / ``WandbLogger``.
        hparams: logged with the session (default: the LightningModule's ``hparams``).
        loss_fn: ``loss_fn(batch) -> loss`` (or ``(pl_module, batch) -> loss``), your loss computation
            for the probes that re-evaluate it (landscape, pre-flight, NaN replay): needed for a
            LightningModule without ``forward`` (``training_step`` calls the sub-modules) to be replayed.
            E.g. ``loss_fn=lambda m, b: F.cross_entropy(m.head(m.body(b[0])), b[1])``.
        **overrides: preset keys for :class:`~trackdiag.Diagnostics` (``every=5``, ``sinks=[...]``,
            ``rules={"nonfinite_loss": {"action": "stop"}}``, ``output_dir=...``).
    Raises:
        ConfigError: the level or an override is invalid (at construction, before training).
        ValueError: ``monitor`` is not a non-empty string.
    """

    def __init__(self, level: str = "advanced", *, monitor: str = "val_loss", eval_keys: Sequence[str] | None = None,
                 join_loggers: bool = True, hparams: Any = None, loss_fn: Any = None, **overrides: Any) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"DiagnosticsCallback(monitor=...): expected the name of a logged metric, got {monitor!r}")
        check_config(level, overrides)
        self.level, self.monitor, self.join_loggers = level, monitor, join_loggers
        self.eval_keys = list(eval_keys) if eval_keys is not None else None
        self.hparams, self.overrides = hparams, dict(overrides)
        self.loss_fn = checked(loss_fn)
        self.diag: Diagnostics | DisabledDiagnostics | None = None
        self._losses: list[Any] = []  # micro-batch losses of the optimizer step in progress
        self._sizes: list[int] = []
        self._seen_step = 0
        self._run: FluentRun | None = None
        self._resume: dict[str, Any] | None = None

    # ------------------------------------------------------------------ results
    @property
    def alerts(self) -> list[Alert]:
        """Every alert of the current (or last) fit."""
        return self.diag.alerts if self.diag is not None else []

    def summary(self) -> dict[str, Any]:
        """The session's summary (alerts per kind, steps, health, overhead)."""
        return (self.diag or DisabledDiagnostics()).summary()

    # ------------------------------------------------------------------ set-up
    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close("FINISHED")  # a session a previous fit left open
        joined = self._join(trainer) if self.join_loggers else []
        optimizers = list(trainer.optimizers)
        optimizer = optimizers[0] if len(optimizers) == 1 else (optimizers or None)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        hparams = self.hparams if self.hparams is not None else dict(getattr(pl_module, "hparams", {}) or {})
        try:
            self.diag = build_session(pl_module, optimizer, scaler, self.level,
                                      join_trackers(self.overrides, joined), hparams, self._batch_loss(pl_module))
        except BaseException:
            self._leave("FAILED")
            raise
        start_at(self.diag, trainer.global_step, self._resume)
        self._resume = None
        self._seen_step = trainer.global_step
        self._losses.clear()
        self._sizes.clear()

    def _batch_loss(self, pl_module: "pl.LightningModule") -> Any:
        """The user's loss as ``fn(batch)``: a two-argument ``loss_fn`` gets the LightningModule too."""
        fn = self.loss_fn
        if fn is None:
            return None
        try:
            two = len(inspect.signature(fn).parameters) >= 2
        except (TypeError, ValueError):
            two = False
        return (lambda batch: fn(pl_module, batch)) if two else fn

    def _join(self, trainer: "pl.Trainer") -> list[str]:
        """The trackers whose run the session writes into (rank 0 only: other ranks write nothing)."""
        if not is_main_process():
            return []
        from lightning.pytorch.loggers import MLFlowLogger, WandbLogger

        joined: list[str] = []
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger) and "mlflow" not in joined:
                run_id = logger.run_id  # creates the run if Lightning has not yet
                run = FluentRun(run_id, getattr(logger, "_tracking_uri", None)) if run_id else None
                if run is not None and run.enter():
                    self._run = run
                    joined.append("mlflow")
            elif isinstance(logger, WandbLogger) and "wandb" not in joined:
                if logger.experiment is not None:  # wandb.init: the run is wandb.run, which the sink joins
                    joined.append("wandb")
        if joined:
            log.info("trackdiag: writing into the Trainer's %s run", " and ".join(joined))
        return joined

    # ------------------------------------------------------------------ training
    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        diag = self.diag
        if diag is None:
            return
        loss, model_out = split_outputs(outputs)
        accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
        if loss is not None and accumulate > 1 and pl_module.automatic_optimization:
            loss = loss * accumulate  # Lightning's closure divided it for the backward (device op)
        self._losses.append(loss)
        size = batch_size_of(batch)
        if size is not None:
            self._sizes.append(size)
        if trainer.global_step == self._seen_step:
            return  # accumulating: no optimizer step in this batch
        self._seen_step = trainer.global_step
        losses, self._losses = self._losses, []
        total, self._sizes = sum(self._sizes) or None, []
        if diag.step(combine_losses(losses), outputs=model_out, batch=batch, batch_size=total):
            trainer.should_stop = True

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if self.diag is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        loss, metrics = eval_metrics(trainer.callback_metrics, self.monitor, VAL_PREFIXES, self.eval_keys)
        if loss is not None or metrics:
            self.diag.log_eval(loss=loss, **metrics)
        # every rank: a rank whose own validation values tripped a stop rule stops them all
        if trainer.strategy.reduce_boolean_decision(bool(self.diag.should_stop), all=False):
            trainer.should_stop = True

    # ------------------------------------------------------------------ end
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._close("FINISHED")

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        if self.diag is not None:
            exit_status.note(self.diag, exception)  # for the crash finding
        self._close(status_of(exception))

    def _close(self, status: str) -> None:
        if self.diag is not None:
            self.diag.close(status)
        self._leave(status)

    def _leave(self, status: str) -> None:
        if self._run is not None:
            self._run.leave(status)
            self._run = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The session's step counter and probe/rule state, saved in Lightning checkpoints."""
        return {"diag": self.diag.state_dict()} if self.diag is not None and self.diag.enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Kept until the next fit start (Lightning restores callbacks before ``on_fit_start``)."""
        self._resume = state_dict.get("diag") or None

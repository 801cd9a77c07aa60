"""What the framework callbacks share: building the session (with the framework's tracker run
joined), aligning its step counter, combining micro-batch losses, picking evaluation metrics.

Host work only, except :func:`combine_losses` (device ops, no host read).
"""
from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import torch

from trackdiag.config.load import resolve
from trackdiag.session.diagnostics import Diagnostics
from trackdiag.session.disabled import DisabledDiagnostics

log = logging.getLogger("trackdiag")

#: sink options that make a sink write into the run the framework's own integration opened
JOIN_OPTIONS: dict[str, dict[str, Any]] = {
    # the framework logs its hyperparameters itself: a second write of the same params with a
    # differently rendered value is an MLflow error, so trackdiag leaves the run's params alone
    "mlflow": {"tracking_uri": None, "attach_active_run": True, "log_params": False},
    "wandb": {"attach": True},
}
TRACKER_SINKS = ("mlflow", "wandb")


def check_config(level: str, overrides: Mapping[str, Any]) -> None:
    """Validate ``level`` and the session overrides now, in the callback's ``__init__``, so a typo
    fails before the framework starts training. Raises :class:`~trackdiag.ConfigError`."""
    resolve({"level": level, **overrides})


def join_trackers(overrides: Mapping[str, Any], joined: Sequence[str]) -> dict[str, Any]:
    """``overrides`` with the sinks of the framework's tracker runs (``joined``: ``mlflow``,
    ``wandb``) set to join those runs. The tracker sinks the preset would add on its own (its
    MLflow run) are replaced: the user's explicit ``sinks`` list is kept and extended."""
    out = dict(overrides)
    if not joined:
        return out
    sinks = list(out["sinks"]) if out.get("sinks") is not None else ["local", "console"]
    out["sinks"] = list(dict.fromkeys([*sinks, *joined]))
    options = {k: dict(v or {}) for k, v in (out.get("sink") or {}).items()}
    for name in joined:
        options[name] = {**options.get(name, {}), **JOIN_OPTIONS[name]}
    out["sink"] = options
    return out


def build_session(model: Any, optimizer: Any, scaler: Any, level: str, overrides: Mapping[str, Any],
                  hparams: Any, loss_fn: Any = None) -> Diagnostics | DisabledDiagnostics:
    """The session (a no-op one when ``enabled=False`` is among the overrides); ``loss_fn``: the
    user's ``loss_fn(batch) -> loss`` (see :mod:`trackdiag.capture.user_loss`)."""
    if overrides.get("enabled", True) is False:
        return DisabledDiagnostics()
    return Diagnostics(model, optimizer, scaler, level=level, hparams=hparams, loss_fn=loss_fn, **overrides)


def start_at(diag: Diagnostics | DisabledDiagnostics, step: int, state: Mapping[str, Any] | None = None) -> None:
    """Number the session's next ``step()`` as ``step`` (the framework's step counter), or restore
    ``state`` (a checkpointed ``diag.state_dict()``) when there is one."""
    if not diag.enabled:
        return
    if state:
        diag.load_state_dict(dict(state))
        if diag.global_step != step:
            log.info("trackdiag: resumed at diagnostics step %d; the trainer is at step %d", diag.global_step, step)
    elif step:
        diag.load_state_dict({"step": int(step), "probes": {}, "rules": {}})


def combine_losses(losses: Sequence[Any], how: str = "mean") -> Any:
    """One optimizer step's loss from its micro-batch losses: their ``mean`` (each a batch mean) or
    ``sum`` (each already a share of the step's loss). Tensors stay on the device (no host read);
    ``None`` when there is none."""
    vals = [v for v in losses if v is not None]
    if not vals:
        return None
    if len(vals) == 1:
        return vals[0]
    if all(isinstance(v, torch.Tensor) for v in vals):
        stacked = torch.stack([v.detach().float().reshape(()) for v in vals])
        return stacked.sum() if how == "sum" else stacked.mean()
    total = sum(float(v) for v in vals)
    return total if how == "sum" else total / len(vals)


def eval_metrics(metrics: Mapping[str, Any], loss_key: str, prefixes: Sequence[str],
                 keys: Sequence[str] | None = None, skip: Sequence[str] = ()) -> tuple[float | None, dict[str, float]]:
    """``(loss, {name: value})`` for ``log_eval`` from a framework's metric dict: ``loss_key`` is the
    loss; the others are ``keys`` (default: every key starting with one of ``prefixes``), named
    without the prefix. Non-numeric values are dropped. One host read per tensor value."""
    def num(v: Any) -> float | None:
        if isinstance(v, torch.Tensor):
            return float(v.detach().float().reshape(-1)[0]) if v.numel() == 1 else None
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    loss = num(metrics[loss_key]) if loss_key in metrics else None
    names = keys if keys is not None else [k for k in metrics if k.startswith(tuple(prefixes))]
    out: dict[str, float] = {}
    for key in names:
        if key == loss_key or key in skip or key not in metrics:
            continue
        value = num(metrics[key])
        if value is None:
            continue
        name = next((key[len(p):] for p in prefixes if key.startswith(p) and len(key) > len(p)), key)
        out[name.replace("/", "_") or key] = value
    return loss, out


def status_of(exc: BaseException | None) -> str:
    """The run status for how training ended."""
    if exc is None:
        return "FINISHED"
    return "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"



"""The user's own loss computation, handed to trackdiag once, for every probe that re-evaluates the loss.

``Diagnostics(model, opt, loss_fn=lambda batch: ...)`` (or ``diag.loss_fn = ...`` later) takes the
batch given to ``step(batch=...)`` and returns the scalar loss, an object with a ``.loss`` (Hugging
Face outputs), a mapping with ``"loss"``, or a ``(loss, outputs)`` tuple. The landscape, the
pre-flight and the NaN replay call it instead of guessing ``model(batch[0])`` against ``batch[1]``:
models that compute their own loss (diffusion, Hugging Face), take several inputs (dense features
plus index/offset tensors), or are driven step by step by the loop (a decoder) work with it. It must
call the session's model(s) (the replay watches their modules; the pre-flight swaps copies of their
weights in), and is only ever called on trackdiag's own side forwards, never on a training step.

Without it, a probe that cannot interpret the batch is skipped with ONE console note per session
(:func:`skipped`) naming the probes and the line that enables them. Host work only here.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import torch

from trackdiag.capture.context import ProbeContext
from trackdiag.core.errors import ConfigError, brief
from trackdiag.core.registry import resolve

log = logging.getLogger("trackdiag")
BatchLoss = Callable[[Any], Any]
NOTE_KEY = "loss_fn"
ENABLE = ("hand trackdiag your loss computation once: Diagnostics(..., loss_fn=lambda batch: <the loss you call "
          "backward() on>) or diag.loss_fn = ... (see docs/crash-and-replay.md)")


def checked(fn: Any) -> BatchLoss | None:
    """``fn`` as a callable (a dotted path is imported); None stays None. Raises ConfigError otherwise."""
    if fn is None:
        return None
    if isinstance(fn, str):
        try:
            fn = resolve(fn)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError([f"loss_fn: cannot import {fn!r} ({brief(exc)})"]) from None
    if not callable(fn):
        raise ConfigError([f"loss_fn: expected a callable taking the batch and returning the loss, got {type(fn).__name__}"])
    return fn


def loss_value(result: Any) -> torch.Tensor:
    """The loss tensor in what a ``loss_fn`` returned (tensor, ``.loss``, ``{"loss": ...}``,
    ``(loss, outputs)``); a loss of several elements is averaged. Raises TypeError when there is none."""
    got = own_loss(result, scalar_only=False)
    if got is None and isinstance(result, (tuple, list)) and result:
        got = own_loss(result[0], scalar_only=False)
    if got is None:
        raise TypeError(f"loss_fn returned {type(result).__name__}, not a loss tensor, an object with .loss "
                        "or a (loss, outputs) tuple")
    return got if got.numel() == 1 else got.float().mean()


def own_loss(outputs: Any, scalar_only: bool = True) -> torch.Tensor | None:
    """The loss a model computed itself: a 0-d floating tensor, a ``.loss`` attribute or a ``"loss"``
    key holding one (``scalar_only=False``: a floating tensor of any shape); else None."""
    cand = outputs
    if not isinstance(cand, torch.Tensor):
        cand = getattr(outputs, "loss", None)
        if cand is None and isinstance(outputs, Mapping):
            cand = outputs.get("loss")
    if isinstance(cand, torch.Tensor) and cand.is_floating_point() and (cand.dim() == 0 or not scalar_only):
        return cand
    return None


def skipped(ctx: ProbeContext, probe: str, why: str) -> None:
    """``probe`` could not evaluate the loss of this model's batches: one console note per session
    (the first probe's), every probe listed in ``summary()["notes"]``."""
    notes = ctx.extra.setdefault("loss_fn_skipped", {})
    if probe in notes:
        return
    notes[probe] = why
    first = len(notes) == 1
    names = "; ".join(f"{name} ({reason})" for name, reason in notes.items())
    ctx.notes[NOTE_KEY] = f"skipped for want of a loss computation: {names}. To enable them, {ENABLE}."
    if first:
        log.warning("trackdiag: %s skipped: it cannot compute this model's loss from the batch given to step() "
                    "(%s). To enable it and the other probes that re-evaluate the loss (landscape, pre-flight, "
                    "NaN replay), %s.", probe, why, ENABLE)

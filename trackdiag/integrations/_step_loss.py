"""The loss of each optimizer step of a Hugging Face ``Trainer``, seen from the model's own output.

The ``Trainer`` hands callbacks no per-step loss (only ``on_log``'s averages, where a NaN is already
replaced: ``logging_nan_inf_filter``). Its default ``compute_loss`` takes the loss from the model's
output (``outputs["loss"]``), so the loss of every training micro-batch is the ``loss`` field of
the model's forward output. This module reads it through trackdiag's forward watcher
(:mod:`trackdiag.capture.forward_watch`: the model's call slot, which ``torch.save`` and ``deepcopy`` drop,
eager forwards only, a no-op while Dynamo traces), keeping a detached reference per micro-batch (no copy, no host read) and
the last micro-batch's keyword arguments as the step's ``batch``.

Combining the micro-batches of one optimizer step like ``Trainer.training_step`` does: when the
forward received ``num_items_in_batch`` (the Trainer passes it to models that accept loss kwargs),
each micro-batch loss is already a share of the step's token-mean loss, and the step's loss is
their **sum** (times the world size under ``average_tokens_across_devices``, as the Trainer
scales it); otherwise each is a batch mean and the step's loss is their **mean**. The result is
the value the Trainer logs as ``loss`` (before its NaN filter).

Not seen: a loss the model does not return (``compute_loss_func``, label smoothing, an overridden
``compute_loss`` that computes its own loss) and the forwards of a compiled model. Then the step
has no loss (one warning); gradients and everything else are still measured.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

from trackdiag.capture.components import batch_size_of
from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.gradtap import TAP_QUEUE
from trackdiag.integrations._common import combine_losses

log = logging.getLogger("trackdiag")


def loss_of(output: Any) -> torch.Tensor | None:
    """The ``loss`` of a model output (``ModelOutput``, dict or object with ``.loss``), or None."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


class StepLoss:
    """Collects the training forwards of ``model`` between two :meth:`take` calls.

    Cost per training forward: one Python call, one ``detach`` (a view), one dict copy of the
    forward's keyword arguments (references to the batch tensors, kept until the step ends).
    """

    def __init__(self, model: nn.Module) -> None:
        self.losses: list[torch.Tensor | None] = []
        self.scaled = False
        self.batch: Any = None
        self.sizes: list[int] = []
        self._warned = False
        self._stop = FORWARD.watch(model, post=self._post, root=True)

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if not module.training or not torch.is_grad_enabled() or TAP_QUEUE.paused:
            return  # evaluation, generation (no grad / eval mode) and trackdiag's own replays (tap paused)
        loss = loss_of(output)
        self.losses.append(loss.detach() if loss is not None else None)
        self.scaled = kwargs.get("num_items_in_batch") is not None
        self.batch = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"} if kwargs else args
        size = batch_size_of(self.batch)
        if size is not None:
            self.sizes.append(size)

    def take(self, world_factor: int = 1) -> tuple[Any, Any, int | None]:
        """``(loss, batch, batch size)`` of the optimizer step that just ended; resets. The loss is a
        device tensor (no host read), or None when no micro-batch loss was seen."""
        losses, self.losses = self.losses, []
        batch, self.batch = self.batch, None
        size, self.sizes = sum(self.sizes) or None, []
        found = [v for v in losses if v is not None]
        if not found:
            if not self._warned:
                self._warned = True
                why = "no training forward of the model was seen" if not losses else "the model's output has no loss"
                log.warning("trackdiag: no loss for this step (%s: a compiled model, a compute_loss_func or label "
                            "smoothing); diag/loss and the loss rules are off, gradients are still measured", why)
            return None, batch, size
        loss = combine_losses(found, "sum" if self.scaled else "mean")
        if self.scaled and world_factor > 1:
            loss = loss * world_factor
        return loss, batch, size

    def close(self) -> None:
        """Stop watching the model."""
        self._stop()

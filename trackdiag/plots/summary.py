"""Model summary: parameters per module, FLOPs per step, input/output shapes of one batch.

``model_summary(model, batch)`` returns a JSON-ready dict:
  ``params_total``, ``params_trainable``, ``buffers_total``;
  ``modules``: rows (forward-registration order, down to ``max_depth``) with ``name``, ``type``,
  ``params``, ``trainable``, ``input``/``output`` shapes seen in the forward;
  ``flops_forward``: from ``torch.utils.flop_counter.FlopCounterMode`` over one forward of the batch;
  ``flops_per_step``: ``3 x flops_forward`` (forward + backward, the usual estimate; the real
  backward is not run, so gradients are never touched).
Cost: one forward pass of one batch, once, in eval mode under ``no_grad`` with the RNG state
forked (training randomness and BatchNorm statistics are unaffected). Without a batch, or when the
model cannot be called on it, only the parameter counts are filled in.
"""
from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
from torch import nn

log = logging.getLogger("trackdiag")


def model_input(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``(args, kwargs)`` to call the model with: a tensor as is, the first item of an ``(x, y)``
    pair, a mapping as keyword arguments. None when there is nothing to call with."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (list, tuple)) and batch:
        return (batch[0],), {}
    if isinstance(batch, Mapping) and batch:
        return (), dict(batch)
    return None


def shape_of(obj: Any) -> Any:
    """Shapes of the tensors in ``obj`` (nested lists/tuples/dicts kept, other values by type name)."""
    if isinstance(obj, torch.Tensor):
        return list(obj.shape)
    if isinstance(obj, (list, tuple)):
        return [shape_of(o) for o in obj[:8]]
    if isinstance(obj, Mapping):
        return {str(k): shape_of(v) for k, v in list(obj.items())[:8]}
    return type(obj).__name__


def _count(params: Any) -> tuple[int, int]:
    total = trainable = 0
    for p in params:
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return total, trainable


def model_summary(model: nn.Module, batch: Any = None, *, max_depth: int = 2, max_rows: int = 200) -> dict[str, Any]:
    """See module docstring."""
    total, trainable = _count(model.parameters())
    out: dict[str, Any] = {
        "model": type(model).__name__, "params_total": total, "params_trainable": trainable,
        "buffers_total": sum(b.numel() for b in model.buffers()), "modules": [],
        "flops_forward": None, "flops_per_step": None,
    }
    rows: dict[str, dict[str, Any]] = {}
    for name, mod in model.named_modules():
        depth = name.count(".") + 1 if name else 0
        if depth > max_depth or len(rows) >= max_rows:
            continue
        t, tr = _count(mod.parameters())
        rows[name] = {"name": name or "(root)", "type": type(mod).__name__, "params": t, "trainable": tr,
                      "input": None, "output": None}
    out["modules"] = list(rows.values())
    call = model_input(batch)
    if call is None:
        return out
    handles = []

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(mod: nn.Module, args: Any, kwargs: Any, result: Any) -> None:
            if rows[name]["input"] is None:
                rows[name]["input"] = shape_of(args[0] if len(args) == 1 else (args or kwargs))
                rows[name]["output"] = shape_of(result)
        return record

    modules = dict(model.named_modules())
    try:
        for name in rows:
            try:
                handles.append(modules[name].register_forward_hook(hook(name), with_kwargs=True))
            except RuntimeError:  # a ScriptModule takes no Python hook: its shapes stay unknown
                continue
        from torch.utils.flop_counter import FlopCounterMode

        from trackdiag.capture.isolation import isolated

        with isolated(model), torch.no_grad():  # buffers, counters, RNG and flags put back afterwards
            model.eval()
            counter = FlopCounterMode(display=False)
            with counter:
                model(*call[0], **call[1])
        out["flops_forward"] = int(counter.get_total_flops())
        out["flops_per_step"] = 3 * out["flops_forward"]
    except Exception as exc:  # the model may need another calling convention: counts still stand
        log.info("trackdiag: model summary could not run a forward pass (%s: %s); parameter counts only",
                    type(exc).__name__, exc)
    finally:
        for h in handles:
            h.remove()
    return out

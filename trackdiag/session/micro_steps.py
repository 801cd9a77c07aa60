"""accelerate's gradient accumulation: the ``Diagnostics.step()`` calls between two real optimizer steps.

Mixed into :class:`trackdiag.Diagnostics` (through :class:`~trackdiag.session.steps.OptimizerEvents`). Inside
``accelerator.accumulate(model)`` a loop calls ``step()`` after every micro-batch; such a call is no optimizer step:
its loss is kept (:attr:`MicroSteps._micro`) and the step that does step records the mean over its micro-batches.
A session without an accelerate object in sight (no optimizer carrying accelerate's gradient state, no model that
``accelerate.prepare`` flagged) never asks: ``step()`` tests :data:`PREPARED` on the models' ``__dict__`` first, C-level.
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.optimizers import accelerate_accumulating, gradient_states

#: a model's ``__dict__`` flag that ``accelerate.prepare`` sets (``map(PREPARED, dicts)``: a C-level pass)
PREPARED = operator.methodcaller("get", "_is_accelerate_prepared")


class MicroSteps:
    """Micro-steps and their losses; see the module docstring."""

    components: list[Component]
    _ctx: ProbeContext

    def _init_micro(self) -> None:
        self._micro: list[Mapping[str, Any]] = []
        self._grad_states: list[Any] = []
        self._find_grad_states()
        self._models = list({id(m): m for c in self.components for m in (c.outer, c.model) if m is not None}.values())
        # what step() looks at before it calls _is_micro_step: the models' own attributes (accelerate.prepare flags a
        # model there, perhaps after the session began) and whether a model's class is flagged
        self._model_dicts = [d for m in self._models if isinstance(d := getattr(m, "__dict__", None), dict)]
        self._typed_accelerate = any(getattr(type(m), "_is_accelerate_prepared", False) for m in self._models) or \
            len(self._model_dicts) < len(self._models)

    def _is_micro_step(self) -> bool:
        """A ``step()`` call between two real optimizer steps (accelerate's ``accumulate``). The given
        optimizers' ``gradient_state`` objects are found when an optimizer is given or adopted."""
        for st in self._grad_states:
            if getattr(st, "sync_gradients", True) is False:
                return True
        for m in self._models:
            if accelerate_accumulating(m):
                return True
        return False

    def _find_grad_states(self) -> None:
        self._grad_states = [st for c in self.components for g in c.given for st in gradient_states(g)]

    def _merge_micro(self, losses: Mapping[str, Any]) -> Mapping[str, Any]:
        """The step's losses: the mean over its micro-batches' losses (device ops only)."""
        if not self._micro:
            return losses
        parts, self._micro = [*self._micro, losses], []
        self._ctx.passes[""] = max(self._ctx.passes.get("", 0), len(parts))
        out: dict[str, Any] = {}
        for name in dict.fromkeys(k for part in parts for k in part):
            vals = [part[name] for part in parts if part.get(name) is not None]
            if vals and all(isinstance(v, torch.Tensor) for v in vals):
                out[name] = torch.stack([v.detach().float().reshape(()) for v in vals]).mean()
            elif vals:
                out[name] = sum(float(v) for v in vals) / len(vals)
        return out

"""``eval_mode`` (the probe): an evaluation run with the model in training mode (``eval_train_mode``).

``model.eval()`` forgotten before a validation pass: dropout stays on (the evaluation is noisy and pessimistic) and
BatchNorm normalises with the evaluation batch's own statistics and folds them into its running ones (what the model
uses later includes the validation data). Nothing crashes.

From the first ``log_eval`` on, the probe watches each model's own calls (its call slot, as the NaN replay does: one
Python call per model call) and counts those made without autograd (``torch.no_grad()``, ``inference_mode``) while the
model is in training mode and holds modules whose behaviour depends on it (``Dropout`` with ``p > 0``, BatchNorm or
InstanceNorm with running statistics, in training mode), since the last ``step()``: an evaluation pass. Training
forwards run with autograd; a no-grad forward inside a training step (a GAN's fake batch, an RL rollout) comes before
that step's ``step()`` and is not counted. At each ``log_eval``: ``diag/[<c>/]model/eval_train_calls`` (such calls
since the last ``step()``) and, when there were any, the table ``[<c>/]model/eval_train_modules``
(``{module: 1.0 dropout | 2.0 normalisation}``). The first evaluation is not watched (the watch starts at it).
Compiled models are not watched (a recompile).

Dropout that ignores the mode (``eval_dropout``): ``F.dropout(x, p)`` in a ``forward`` without
``training=self.training`` (its default is ``True``) stays on after ``model.eval()``; so does
``F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)`` without ``if self.training else 0.0``. The first call of a model in
eval mode after each of the next ``SPY_EVALS`` (3) ``log_eval`` runs under a :class:`DropoutSpy` (a
``TorchFunctionMode`` that sees every torch function of that one call and passes it through): a functional dropout
with ``training=True`` and ``p > 0`` called from a module in eval mode is recorded with the module's name (an
``nn.Dropout`` kept in training mode on purpose, Monte Carlo dropout, is its module's choice: not recorded). At the
next ``log_eval``: the table ``[<c>/]model/eval_dropout`` (``{module: p}``). Cost: the spied call runs its torch
functions through Python (~2-5x slower: one call of each of three evaluations); nothing per step.
"""
from __future__ import annotations

import sys
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from trackdiag.capture.context import ProbeContext
from trackdiag.core.record import Record
from trackdiag.probes._eval_watch import EvalWatchProbe
from trackdiag.probes.modes import mode_dependent


#: functional dropouts and where their ``p`` / ``training`` arguments sit: ``F.dropout(input, p, training, inplace)``
#: and its 1d/2d/3d/alpha variants; ``torch.dropout(input, p, train)`` and the feature variants the same; and
#: ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)``, whose dropout has no training flag
DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
                      torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
                      F.scaled_dot_product_attention})
_SDPA = F.scaled_dot_product_attention  # its ``dropout_p`` applies in any mode: ``dropout_p=p if self.training else 0``
SPY_EVALS = 3


class DropoutSpy(TorchFunctionMode):
    """Records the functional dropouts with ``training=True`` called from a module of ``model`` in eval mode during
    one call (``found``: ``{module name: p}``); every torch function passes through unchanged."""

    def __init__(self, model: nn.Module, found: dict[str, float]) -> None:
        super().__init__()
        self.model, self.found = model, found
        self._names: dict[int, str] | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in DROPOUTS:
            try:
                self._saw(func, args, kwargs)
            except Exception:  # noqa: BLE001 - never raise into the user's forward
                pass
        return func(*args, **kwargs)

    def _saw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if func is _SDPA:  # attention dropout: applied whenever dropout_p > 0 (no training flag)
            p, on = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0), True
        else:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            on = kwargs.get("training", kwargs.get("train", args[2] if len(args) > 2 else True))
        if not on or not p:
            return
        if self._names is None:
            self._names = {id(m): name for name, m in self.model.named_modules()}
        frame = sys._getframe(2)
        while frame is not None:  # the innermost module of the model whose code called it
            owner = frame.f_locals.get("self")
            if isinstance(owner, nn.Module) and id(owner) in self._names:
                if not owner.training:  # an nn.Dropout kept in training mode on purpose is its own choice
                    self.found[self._names[id(owner)] or type(owner).__name__] = float(p)
                return
            frame = frame.f_back


class EvalModeProbe(EvalWatchProbe):
    """See module docstring."""

    name = "eval_mode"

    def __init__(self, *, enabled: bool = True, every: int | None = None) -> None:
        super().__init__(enabled=enabled, every=every)
        self._calls: dict[str, tuple[int, int]] = {}  # component -> (ctx.step of the calls, no-grad train-mode calls)
        self._spy: dict[str, int] = {}  # component -> evaluations whose first eval-mode call is still to spy on
        self._spied: dict[str, dict[str, float]] = {}  # component -> dropouts found on at evaluation {module: p}
        self._spy_due: dict[str, bool] = {}  # component -> its next eval-mode call is spied on

    def _saw(self, name: str, model: nn.Module, module: nn.Module, args: tuple[Any, ...]) -> DropoutSpy | None:
        """Pre-watcher of a model's call: count a no-grad call in training mode (an evaluation pass); the first call
        in eval mode after a ``log_eval`` whose spy is due runs under a :class:`DropoutSpy`."""
        if module.training:
            if not torch.is_grad_enabled() and self._ctx is not None:
                step, n = self._calls.get(name, (-1, 0))
                self._calls[name] = (self._ctx.step, n + 1 if step == self._ctx.step else 1)
            return None
        if self._spy.get(name, 0) > 0 and self._spy_due.get(name, False):
            self._spy_due[name] = False
            self._spy[name] -= 1
            return DropoutSpy(model, self._spied.setdefault(name, {}))
        return None

    def on_eval(self, ctx: ProbeContext, record: Record) -> None:
        """At ``log_eval``: what the models' calls since the last ``step()`` say; the watch starts at the first."""
        if not self.watching:
            for comp in self.watch_models(ctx, lambda c: partial(self._saw, c.name, c.model)):
                self._spy[comp.name] = SPY_EVALS
                self._spy_due[comp.name] = True
            return
        for comp in ctx.components:
            found = self._spied.pop(comp.name, None)
            if found:
                record.tables[comp.key("model/eval_dropout")] = found
            if self._spy.get(comp.name, 0) > 0 and not found:
                self._spy_due[comp.name] = True  # the next evaluation's first eval-mode call
            elif found:
                self._spy[comp.name] = 0
            step, n = self._calls.pop(comp.name, (-1, 0))
            if comp.model is None or step != ctx.step:
                continue
            modules = mode_dependent(comp.model, training=True)
            record.scalars[comp.key("model/eval_train_calls")] = float(n)
            if modules:
                record.tables[comp.key("model/eval_train_modules")] = modules

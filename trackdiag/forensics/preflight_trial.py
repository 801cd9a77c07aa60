"""Where the pre-flight trains: copies of the models and optimizers, never the user's.

:class:`Trial` holds, per model, a deep copy (:func:`clone_model`: trackdiag's hooks become no-ops)
and a copy of its optimizer (:func:`copy_optimizer`: same class, hyperparameters and a deep copy of
its state). The loss is evaluated one of two ways:

  * ``forward(model, batch)`` / ``model(inputs_of(batch))`` called on the copy, scored by
    ``loss_fn(outputs, batch)``, the model's own loss, or the guessed cross-entropy/MSE;
  * the user's loss computation ``batch_loss(batch)`` (:mod:`trackdiag.capture.user_loss`), which calls the
    *user's* models: inside :meth:`Trial.swapped` their parameters and buffers are the copies' tensors
    (``torch.nn.utils.stateless``), so their gradients, optimizer steps and BatchNorm statistics land
    in the copies; forward watchers, the gradient tap and the optimizer step hooks are paused.

Cost: one copy of each model and optimizer state while the pre-flight runs. Host work only here.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

import torch
from torch import nn

from trackdiag.capture.user_loss import loss_value, own_loss
from trackdiag.util.tensors import default_loss, float_tensors, inputs_of

Forward = Callable[[nn.Module, Any], Any]
LossFn = Callable[[Any, Any], torch.Tensor]
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def copy_optimizer(opt: torch.optim.Optimizer, model: nn.Module, clone: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer of the same class and hyperparameters (and state) stepping ``clone``'s
    parameters; ``None`` when some of ``opt``'s parameters are not ``model``'s."""
    names = {id(p): n for n, p in model.named_parameters()}
    cparams = dict(clone.named_parameters())
    if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
        return None
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [cparams[names[id(p)]] for p in g["params"]]}
              for g in opt.param_groups]
    try:
        new = type(opt)(groups, **opt.defaults)
    except TypeError:
        new = type(opt)(groups)
    try:  # a deep copy: load_state_dict would otherwise share the state tensors with the user's optimizer
        new.load_state_dict(copy.deepcopy(opt.state_dict()))
    except (ValueError, KeyError, RuntimeError):
        pass  # a fresh state is fine for these checks
    return new


def _ours(hook: Any) -> bool:
    """A hook registered by trackdiag (a probe's bound method, a partial of one, a SafeHook)."""
    fn = getattr(hook, "func", hook)
    owner = getattr(fn, "__self__", None)
    module = type(owner).__module__ if owner is not None else (getattr(fn, "__module__", None) or type(fn).__module__)
    return module.startswith("trackdiag.")


def _noop(*_: Any, **__: Any) -> None:
    return None


def clone_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` in which every trackdiag hook is a no-op (the probes are not copied)."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for attr in _HOOK_DICTS:
            for hook in getattr(m, attr, {}).values():
                if _ours(hook):
                    memo[id(hook)] = _noop
    return copy.deepcopy(model, memo)


def surrogate_or_loss(outputs: Any, batch: Any, loss_fn: LossFn | None) -> tuple[torch.Tensor, bool]:
    """The loss of ``outputs`` and whether it is a real one: ``loss_fn``, the model's own loss, the
    guessed cross-entropy/MSE, else a surrogate (the mean square of the outputs)."""
    if loss_fn is not None:
        return loss_fn(outputs, batch), True
    guessed = own_loss(outputs)
    if guessed is None:
        guessed = default_loss(outputs, batch)
    if guessed is not None:
        return guessed, True
    outs = [t.float().pow(2).mean() for _, t in float_tensors(outputs, "") if t.requires_grad]
    return (sum(outs[1:], outs[0]) if outs else torch.zeros(())), False


class Trial:
    """Copies of ``parts`` (``(name, model, [optimizers])``) and a way to evaluate the loss on them."""

    def __init__(self, parts: list[tuple[str, nn.Module, Any]], batch: Any, *, loss_fn: LossFn | None = None,
                 forward: Forward | None = None, batch_loss: Callable[[Any], Any] | None = None) -> None:
        self.parts = parts
        self.batch, self.loss_fn, self.batch_loss = batch, loss_fn, batch_loss
        self.call = forward or (lambda m, b: m(inputs_of(b)))
        self.clones = [clone_model(m) for _, m, _ in parts]
        #: the user's trainable parameters, taken before any swap (inside one, the models show the copies')
        self.originals = [[(n, p) for n, p in m.named_parameters() if p.requires_grad] for _, m, _ in parts]
        self.opts = [copy_optimizer(o, m, c) for (_, m, opts), c in zip(parts, self.clones) for o in opts]

    @property
    def multi(self) -> bool:
        return len(self.parts) > 1

    def named(self, i: int, name: str) -> str:
        """A parameter's name as the report shows it (``<component>.<name>`` with several models)."""
        return f"{self.parts[i][0]}.{name}" if self.multi else name

    @contextlib.contextmanager
    def calls_seen(self) -> Iterator[set[int] | None]:
        """The ``id`` of every module called inside (a global forward hook while it lasts; the copies and,
        with ``batch_loss``, the user's modules); None for a compiled model (a hook would cost it a
        recompile): then nothing is known."""
        from trackdiag.capture.forward_watch import compiled_parts

        if any(compiled_parts(m) for _, m, _ in self.parts):
            yield None
            return
        seen: set[int] = set()
        handle = nn.modules.module.register_module_forward_hook(lambda m, _a, _o: seen.add(id(m)))
        try:
            yield seen
        finally:
            handle.remove()

    def called(self, i: int, seen: set[int] | None) -> set[str] | None:
        """Names of model ``i``'s modules among ``seen`` (its copy's or, with ``batch_loss``, its own)."""
        if seen is None:
            return None
        models = (self.clones[i], self.parts[i][1])
        return {n for m in models for n, mod in m.named_modules() if id(mod) in seen}

    def loss(self) -> tuple[torch.Tensor, bool]:
        """(loss, real) on the copies."""
        if self.batch_loss is not None:
            return loss_value(self.batch_loss(self.batch)), True
        return surrogate_or_loss(self.call(self.clones[0], self.batch), self.batch, self.loss_fn)

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """With ``batch_loss``: the user's models run on the copies' tensors; always: trackdiag's own
        watchers (forward, gradient tap, optimizer steps) do not see the pre-flight."""
        from torch.nn.utils.stateless import _reparametrize_module

        from trackdiag.capture.forward_watch import FORWARD
        from trackdiag.capture.gradtap import TAP_QUEUE
        from trackdiag.capture.optimizers import DISPATCH

        with contextlib.ExitStack() as stack:
            stack.enter_context(FORWARD.paused())
            stack.enter_context(TAP_QUEUE.pause())
            stack.enter_context(DISPATCH.paused())
            if self.batch_loss is not None:
                for (_, model, _), clone in zip(self.parts, self.clones):
                    tensors = {**dict(clone.named_parameters(remove_duplicate=False)),
                               **dict(clone.named_buffers(remove_duplicate=False))}
                    stack.enter_context(_reparametrize_module(model, tensors))
            yield

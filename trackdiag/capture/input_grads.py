"""Does a forward call ask for gradients of its *inputs*?

Adversarial training (FGSM: ``x.requires_grad_()``; PGD: ``model(x + delta)`` with a ``delta`` that
requires grad), saliency maps and input optimisation run a backward pass for the input's gradient;
it fills the parameters' ``.grad`` too, and the loop then zeroes those before the real backward.
That pass is not part of the optimizer step, so two resets in one step are no accumulation mistake
(:mod:`trackdiag.probes.zerograd`). Told apart from a model fed another trained module's output (an
encoder's, a generator's), whose graph leads to ``nn.Parameter`` leaves: an input counts when it is a
leaf that requires grad or its graph reaches, within a few nodes, a leaf that is not a parameter.

Cost: host work only; the graph walk (:func:`wanted`, ~2 us per node) visits at most ``_NODES``
autograd nodes and is meant for the rare step that needs it, on tensors :func:`grad_inputs` kept.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

_NODES = 16


def asks_input_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a tensor among ``args``/``kwargs`` (one level into lists, tuples and dicts) is an input
    whose gradient the caller wants (see module docstring)."""
    return wanted(grad_inputs(args, kwargs))


def grad_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among ``args``/``kwargs`` that require grad (cheap: no graph walk), for
    :func:`wanted` later."""
    found = [t for t in _tensors(args) if t.requires_grad]
    if kwargs:
        found += [t for t in _tensors(kwargs.values()) if t.requires_grad]
    return found


def wanted(tensors: list[torch.Tensor]) -> bool:
    """Whether one of ``tensors`` asks for its gradient (the graph walk; the graph may have been
    back-propagated already: its structure stays while the tensors are held)."""
    return any(_wanted(t) for t in tensors)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, torch.Tensor))
        elif isinstance(v, dict):
            yield from (t for t in v.values() if isinstance(t, torch.Tensor))


def _wanted(t: torch.Tensor) -> bool:
    if not t.requires_grad:
        return False
    if t.grad_fn is None:  # a leaf: x.requires_grad_()
        return not isinstance(t, nn.Parameter)
    todo, seen = [t.grad_fn], 0
    while todo and seen < _NODES:
        node = todo.pop()
        seen += 1
        var = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if var is not None:
            if not isinstance(var, nn.Parameter):
                return True
            continue
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False

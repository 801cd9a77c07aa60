"""Whether a loss's autograd graph reaches the parameters an optimizer holds.

Asked only when no gradient reached any of those parameters (the pre-clip norm exactly 0 at a logging step): the
answer tells the usual causes apart (``grads_missing``). A loss made to require grad with no graph behind it was
computed under ``torch.no_grad()`` or detached and then given ``requires_grad_(True)``; a loss given to ``step()``
detached tells nothing (loops pass one for logging). One whose graph does not reach them comes from another model
than the one the optimizer was built over (a model replaced by ``copy.deepcopy`` or re-created and loaded after the
optimizer was built); one whose graph reaches them was never back-propagated (``loss.backward()`` not called). The
graph's structure stays walkable after ``backward()`` while the loss is held (its saved tensors are freed, its nodes
are not).

Cost: one pass over the graph's nodes, at most ``NODES``; nothing on a healthy run (never asked).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

NODES = 100_000  #: nodes walked at most (a graph larger than this without the parameters: unknown)


def graph_reach(loss: Any, params: Iterable[torch.Tensor]) -> dict[str, float]:
    """``{"graph": 1.0 or 0.0}``: whether the loss is the result of operations autograd recorded. A loss detached,
    or made to require grad with ``requires_grad_(True)`` after a forward under ``no_grad``, has none; the latter is
    marked ``"leaf": 1.0``, the one signature of that mistake (a loss given detached may just be one logged). For a
    loss with a graph, ``"reaches"``: 1.0 when a node accumulates into one of ``params``, 0.0 when none does, -1.0
    when the walk stopped at ``NODES``. ``{}`` when ``loss`` is not a tensor."""
    if not isinstance(loss, torch.Tensor):
        return {}
    if not loss.requires_grad:  # detached: for logging (loss.detach()), or computed without autograd
        return {"graph": 0.0}
    if loss.grad_fn is None:  # a leaf that requires grad: a loss made to by requires_grad_(True)
        return {"graph": 0.0, "leaf": 1.0}
    ids = {id(p) for p in params}
    todo, seen = [loss.grad_fn], set()
    while todo:
        if len(seen) >= NODES:
            return {"graph": 1.0, "reaches": -1.0}
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # an AccumulateGrad node: its leaf
        if var is not None and id(var) in ids:
            return {"graph": 1.0, "reaches": 1.0}
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return {"graph": 1.0, "reaches": 0.0}

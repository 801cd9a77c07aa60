"""Turn the user's model(s) and optimizer(s) into named :class:`Component` objects."""
from __future__ import annotations

from typing import Any, Mapping

from torch import nn

from trackdiag.context import Component
from trackdiag.errors import TrackdiagError
from trackdiag.layers import LayerIndex


def unwrap(model: Any) -> Any:
    """The module inside DDP/DataParallel/``torch.compile`` wrappers (names lose ``module.``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def build_components(model: Any, optimizer: Any, budget: int) -> list[Component]:
    """One component per named model/optimizer pair.

    A single model and optimizer give one unnamed component. Dicts are paired by key
    (``{"G": g, "D": d}`` with ``{"G": opt_g, "D": opt_d}``). A dict of models with one optimizer
    becomes one component whose layer names are prefixed with the model keys.
    """
    if isinstance(model, Mapping) and not isinstance(optimizer, Mapping):
        model = nn.ModuleDict({k: unwrap(m) for k, m in model.items()})
    models = {k: unwrap(m) for k, m in model.items()} if isinstance(model, Mapping) else {"": unwrap(model)}
    opts = dict(optimizer) if isinstance(optimizer, Mapping) else {"": optimizer}
    names = list(dict.fromkeys([*models, *opts])) if len(models) > 1 or len(opts) > 1 else [""]
    comps = []
    for name in names:
        m = models.get(name, models.get("") if len(models) == 1 else None)
        if m is None and len(models) == 1:
            m = next(iter(models.values()))
        o = opts.get(name, opts.get("") if len(opts) == 1 else None)
        if o is not None:
            params = [p for g in o.param_groups for p in g["params"]]
        elif m is not None:
            params = [p for p in m.parameters() if p.requires_grad]
        else:
            raise TrackdiagError(f"component {name!r} has neither a model nor an optimizer")
        comps.append(Component(name, m, o, LayerIndex.build(m, params, budget)))
    return comps


def batch_size_of(batch: Any) -> int | None:
    """Leading dimension of the first tensor in ``batch`` (tensor, sequence or mapping); host only."""
    if batch is None:
        return None
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    return None

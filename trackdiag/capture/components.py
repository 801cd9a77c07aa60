"""Turn the user's model(s) and optimizer(s) into named :class:`Component` objects."""
from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trackdiag.capture.context import Component
from trackdiag.capture.layers import LayerIndex
from trackdiag.capture.optimizers import param_groups, real_optimizer
from trackdiag.core.errors import TrackdiagError

_PARAMS = operator.itemgetter("params")


def unwrap(model: Any) -> Any:
    """The module inside DDP/DataParallel/``torch.compile`` wrappers (names lose ``module.``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module) or inner is model:
            return model
        model = inner


def module_key(name: str, taken: set[str]) -> str:
    """``name`` as a ``ModuleDict`` key (no dots, not empty), unique among ``taken``."""
    key = (str(name) or "_").replace(".", "_")
    while key in taken:
        key += "_"
    taken.add(key)
    return key


def _optimizers(opt: Any) -> list[Any]:
    """The user's optimizer argument for one component as a list (``None`` -> ``[]``)."""
    if opt is None:
        return []
    return [o for o in opt if o is not None] if isinstance(opt, (list, tuple)) else [opt]


def build_components(model: Any, optimizer: Any, budget: int) -> list[Component]:
    """One component per named model/optimizer pair.

    A single model and optimizer give one unnamed component. Dicts are paired by key
    (``{"G": g, "D": d}`` with ``{"G": opt_g, "D": opt_d}``); any string works as a key. A dict of
    models with one optimizer becomes one component whose layer names are prefixed with the model
    keys. One model with a dict (or list) of optimizers is one component that all of them step. An
    optimizer may be a wrapper (accelerate, Lightning, ZeRO, Lookahead: the optimizer that
    really steps is found inside), a list of optimizers, or ``None`` (found when it first steps).
    """
    if not isinstance(model, Mapping) and isinstance(optimizer, Mapping):
        # one model, several optimizers over parts of it (SparseAdam for an embedding + Adam for the rest,
        # Muon for matrices + AdamW for the rest): one component that all of them step
        optimizer = [o for o in optimizer.values() if o is not None]
    if isinstance(model, Mapping) and not isinstance(optimizer, Mapping):
        taken: set[str] = set()
        model = nn.ModuleDict({module_key(k, taken): unwrap(m) for k, m in model.items()})
    outers = {str(k): m for k, m in model.items()} if isinstance(model, Mapping) else {"": model}
    models = {k: unwrap(m) for k, m in outers.items()}
    opts = {str(k): v for k, v in optimizer.items()} if isinstance(optimizer, Mapping) else {"": optimizer}
    names = list(dict.fromkeys([*models, *opts])) if len(models) > 1 or len(opts) > 1 else [""]
    comps = []
    for name in names:
        m = models.get(name, models.get("") if len(models) == 1 else None)
        if m is None and len(models) == 1:
            m = next(iter(models.values()))
        given = _optimizers(opts.get(name, opts.get("") if len(opts) == 1 else None))
        if m is None and not given:
            raise TrackdiagError(f"component {name!r} has neither a model nor an optimizer")
        comp = Component(name, m, None, LayerIndex.build(m, [], budget), given=given,
                         outer=outers.get(name, next(iter(outers.values())) if len(outers) == 1 else m))
        for o in given:
            comp.add_optimizer(o)
        reindex(comp, budget)
        comps.append(comp)
    return comps


def component_params(comp: Component) -> list[Any]:
    """The parameters a component's statistics cover: those its optimizers step (every param group,
    in order, each once), else the model's trainable parameters."""
    seen: set[int] = set()
    params = []
    for o in comp.optimizers or [g for g in comp.given if param_groups(g)]:
        for group in param_groups(o):
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
    if not params and comp.model is not None:
        params = [p for p in comp.model.parameters() if p.requires_grad]
    return params


def reindex(comp: Component, budget: int) -> bool:
    """Rebuild ``comp.index`` if its parameter list changed (a param group added, a layer
    unfrozen, parameters materialised later); True when it did. Host work only."""
    params = component_params(comp)
    signature = tuple((id(p), p.requires_grad) for p in params)
    if signature == comp.signature:
        return False
    comp.signature = signature
    comp.index = LayerIndex.build(comp.model, params, budget)
    comp.generation += 1
    return True


def groups_signature(comp: Component) -> tuple[Any, ...]:
    """A cheap fingerprint of the component's optimizers' param groups (number of groups and of
    tensors per group): it changes with ``add_param_group``."""
    # comp.optimizers are torch optimizers (the wrappers' inner ones): their own param_groups, no wrapper walk;
    # a new optimizer re-indexes the component when it is adopted, so the optimizers' identities are left out
    opts = comp.optimizers
    if len(opts) == 1:  # the usual one optimizer: C-level passes, no comprehension's frame on every step
        return (*map(len, map(_PARAMS, opts[0].param_groups)), 1)
    return tuple([len(g["params"]) for o in opts for g in o.param_groups] + [len(opts)])


def attachable(comp: Component, opt: Any) -> bool:
    """True when ``opt`` steps some of ``comp``'s model's parameters (or the component has no
    model and no optimizer yet)."""
    ids = {id(p) for g in param_groups(opt) for p in g["params"]}
    if comp.model is not None:
        return any(id(p) in ids for p in comp.model.parameters())
    return any(id(p) in ids for p in comp.index.params)


def replaced(comp: Component, opt: Any) -> Any | None:
    """The optimizer of ``comp`` that ``opt`` takes the place of: one of the same class over the same parameters in
    the same order (a loop that creates its optimizer anew: per stage, per epoch, or by mistake at every step);
    None when ``opt`` steps other parameters (a second optimizer: a GAN's, a per-layer phase's). Host work, when an
    optimizer is adopted."""
    real = real_optimizer(opt)
    if real is None:
        return None
    mine = [id(p) for g in param_groups(real) for p in g["params"]]
    for old in comp.optimizers:
        if type(old) is type(real) and old is not real and [id(p) for g in old.param_groups for p in g["params"]] == mine:
            return old
    return None


def stateful(opt: Any) -> bool:
    """Whether ``opt`` keeps state between steps that a fresh one starts without (Adam's moment estimates, SGD's
    momentum buffer); plain SGD keeps none. Host work: its ``state`` entries."""
    state = getattr(opt, "state", None) or {}
    return any(isinstance(v, torch.Tensor) and k != "step" for s in list(state.values())[:4] for k, v in s.items())


def stepped_inputs(comp: Component) -> list[Any]:
    """The tensors ``comp``'s optimizers step when none of them is a parameter of its model (an input
    optimised: style transfer, adversarial examples, feature visualisation step an image while the model
    is held fixed); ``[]`` in an ordinary loop. Host only: one pass over the model's parameter ids."""
    if comp.model is None or not comp.optimizers or not comp.index.params:
        return []
    owned = {id(p) for p in comp.model.parameters()}
    return [] if any(id(p) in owned for p in comp.index.params) else list(comp.index.params)


def batch_size_of(batch: Any) -> int | None:
    """Leading dimension of the first tensor in ``batch`` (tensor, sequence or mapping); host only."""
    if batch is None:
        return None
    if hasattr(batch, "shape"):
        return int(batch.shape[0]) if len(batch.shape) else None
    if type(batch) in (tuple, list):  # the usual ``(x, y)``: before the slower Mapping test
        return batch_size_of(batch[0]) if batch else None
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    return None


__all__ = ["attachable", "batch_size_of", "build_components", "component_params", "groups_signature",
           "real_optimizer", "reindex", "replaced", "stateful", "stepped_inputs", "unwrap"]

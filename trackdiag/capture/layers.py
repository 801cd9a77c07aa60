"""Map parameter tensors to layers (their owning modules) and layers to metric-key groups."""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trackdiag.util.norms import all_finite, grad_norms
from trackdiag.util.ranks import is_sharded, local

#: ``g is None`` as a C callable (``any(map(...))`` walks the gradients without a Python frame per tensor)
_is_none = functools.partial(operator.is_, None)

ROOT = "(root)"


def layer_of(param_name: str) -> str:
    """``encoder.0.weight`` -> ``encoder.0``; a parameter of the root module -> ``(root)``."""
    head, _, _ = param_name.rpartition(".")
    return head or ROOT


def group_names(layers: list[str], budget: int) -> list[str]:
    """Coarsen layer names (truncating at dots, deepest first) until at most ``budget`` distinct
    groups remain. Returns the group name of each layer, in order."""
    depth = max((n.count(".") + 1 for n in layers), default=1)
    while depth > 0:
        groups = [".".join(n.split(".")[:depth]) for n in layers]
        if len(dict.fromkeys(groups)) <= budget:
            return groups
        depth -= 1
    return ["all"] * len(layers)


@dataclass
class LayerIndex:
    """The parameters one optimizer steps, named after the model and grouped by layer.

    ``index[i]`` is the layer of ``params[i]``; ``group_index[j]`` the key group of ``layers[j]``.
    Built once at attach: the hot path only uses the precomputed index tensors. ``grads()``,
    ``grad_norms()`` and ``param_norms()`` are computed once per optimizer-step hook (the session calls
    ``clear_cache()`` when the hook's probes are done, so no gradient outlives a ``zero_grad``), and
    the probes reading them at the same hook share one kernel launch.
    """

    params: list[torch.Tensor]
    names: list[str]
    layers: list[str]
    index: torch.Tensor
    groups: list[str]
    group_index: torch.Tensor
    grouped: bool
    _zeros: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)
    sharded: bool = False  # some parameters are DTensors (FSDP2): read their local shards
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)  # never rebound: clear_cache is its clear
    index_of: list[int] = field(default_factory=list)  # host copy of ``index``
    low_precision: bool = False  # some parameters are fp16/bf16: norms accumulate in fp32
    #: the global norm is the foreach norms' norm (one device, unsharded; on the CPU at most 64 tensors, whatever
    #: their size: in the training loop one ``_foreach_norm`` beats :func:`~trackdiag.util.norms.global_norm`'s
    #: dots and chunks there, 120-185 against 235-335 us on the 12-18 ms CPU workloads of ``benchmarks/``, and it is
    #: ``clip_grad_norm_``'s own arithmetic), decided once here instead of per pass
    foreach: bool = False
    _cache_pos: dict[int, int] | None = field(default=None, repr=False)

    @classmethod
    def build(cls, model: nn.Module | None, params: list[torch.Tensor], budget: int) -> "LayerIndex":
        by_id: dict[int, str] = {}
        if model is not None:
            for n, p in model.named_parameters(remove_duplicate=False):
                by_id.setdefault(id(p), n)
        names = [by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]
        layer_names = [layer_of(n) for n in names]
        layers = list(dict.fromkeys(layer_names))
        pos = {n: i for i, n in enumerate(layers)}
        device = params[0].device if params else torch.device("cpu")
        index_of = [pos[n] for n in layer_names]
        index = torch.tensor(index_of, dtype=torch.long, device=device)
        group_of_layer = group_names(layers, budget)
        groups = list(dict.fromkeys(group_of_layer))
        gpos = {g: i for i, g in enumerate(groups)}
        group_index = torch.tensor([gpos[g] for g in group_of_layer], dtype=torch.long, device=device)
        low = any(p.dtype in (torch.float16, torch.bfloat16) for p in params)
        sharded = any(is_sharded(p) for p in params)
        devices = {p.device for p in params}
        foreach = len(devices) == 1 and not sharded and not any(p.is_complex() for p in params) and (
            device.type != "cpu" or len(params) <= 64)
        return cls(params, names, layers, index, groups, group_index, grouped=len(groups) < len(layers),
                   sharded=sharded, index_of=index_of, low_precision=low, foreach=foreach)

    def position(self, param: torch.Tensor) -> int | None:
        """The position of ``param`` in ``params`` (None if not there); a dict built at the first call."""
        pos = self._cache_pos
        if pos is None:
            pos = self._cache_pos = {id(p): i for i, p in enumerate(self.params)}
        return pos.get(id(param))

    def grads(self) -> list[torch.Tensor]:
        """Each parameter's gradient (this rank's shard of a DTensor gradient under FSDP2); a zero
        scalar stands in where ``grad`` is None. Cached for this hook, like the norms."""
        out = self._cache.get("grads")
        if out is not None:
            return out
        grads = [p.grad for p in self.params]
        if self.sharded:
            grads = [local(g) if g is not None else None for g in grads]
        if any(map(_is_none, grads)):  # no Python frame per tensor
            grads = [g if g is not None else self._zero(p.device) for g, p in zip(grads, self.params)]
        self._cache["grads"] = grads
        return grads

    def _zero(self, device: torch.device) -> torch.Tensor:
        z = self._zeros.get(device)
        if z is None:
            z = self._zeros[device] = torch.zeros((), device=device)
        return z

    def grad_norms(self) -> torch.Tensor:
        """Per-parameter L2 norms of :meth:`grads` (one ``_foreach_norm``; cached for this hook)."""
        norms = self._cache.get("grad")
        if norms is None:
            norms = self._cache["grad"] = grad_norms(self.grads(), self.low_precision)
        return norms

    def grads_finite(self) -> torch.Tensor:
        """Whether every gradient is finite (0-d bool on device): from the norms when this hook has
        them already, else :func:`~trackdiag.util.norms.all_finite` (no norms computed)."""
        norms = self._cache.get("grad")
        return torch.isfinite(norms).all() if norms is not None else all_finite(self.grads())

    def param_norms(self) -> torch.Tensor:
        """Per-parameter L2 norms of the (local shards of the) parameters; cached for this hook."""
        norms = self._cache.get("param")
        if norms is None:
            with torch.no_grad():  # no detach() per tensor: 2.8 us each on the CPU (8 ms for 3,000 tensors)
                params = [local(p.detach()) for p in self.params] if self.sharded else self.params
                norms = self._cache["param"] = grad_norms(params, self.low_precision)
        return norms

    def __post_init__(self) -> None:
        #: forget the cached norms (gradients or parameters may have changed since they were taken): the cache's own
        #: ``clear``, bound once (the hooks call it on every step; a method would add a Python frame each time)
        self.clear_cache = self._cache.clear

    def per_layer_norm(self, norms: torch.Tensor) -> torch.Tensor:
        """L2 norm per layer from per-tensor L2 norms (one index_add, no host sync)."""
        sq = torch.zeros(len(self.layers), dtype=norms.dtype, device=norms.device)
        return sq.index_add_(0, self.index.to(norms.device), norms * norms).sqrt_()

    def per_layer_max(self, values: torch.Tensor) -> torch.Tensor:
        """Max per layer from per-tensor values."""
        out = torch.zeros(len(self.layers), dtype=values.dtype, device=values.device)
        return out.scatter_reduce_(0, self.index.to(values.device), values, "amax", include_self=False)

    def per_group_norm(self, layer_norms: torch.Tensor) -> torch.Tensor:
        sq = torch.zeros(len(self.groups), dtype=layer_norms.dtype, device=layer_norms.device)
        return sq.index_add_(0, self.group_index.to(layer_norms.device), layer_norms * layer_norms).sqrt_()

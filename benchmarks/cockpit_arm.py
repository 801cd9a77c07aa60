"""The Cockpit peer arm: ``Cockpit(configuration("economy"))`` tracking every 10 steps, used the way
Cockpit's own examples use it (model and loss ``extend``-ed by BackPACK, individual losses and the
optimizer handed in through ``info``, the backward pass inside ``with cockpit(step, info=...)``).

Install it with ``bash scripts/bench_setup.sh`` (``--no-deps``: no torchvision, torch untouched).
"economy" is Alpha, Distance, GradHist1d, GradNorm, InnerTest, Loss, NormTest, OrthoTest and
UpdateSize: first-order BackPACK quantities (per-sample gradients on tracked steps).

BackPACK computes per-sample gradients only for the modules it has extensions for (Linear, Conv,
BatchNorm, Embedding, RNN/LSTM...): a model with a parameter elsewhere (LayerNorm, MultiheadAttention's
functionally used in-projection, a bare ``nn.Parameter`` used in ``forward``) cannot be tracked, and
``unsupported`` says why so the benchmark skips it with that reason instead of failing.
"""
from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

EVERY = 10


def importable() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("cockpit", "backpack"))


def unsupported(model: nn.Module, *, compiled: bool = False, scaled: bool = False) -> str | None:
    """Why Cockpit cannot run on this model/setting, or None when it can."""
    if compiled:
        return "BackPACK's module hooks and per-sample backward are not traceable by torch.compile"
    if scaled:
        return "Cockpit's quantities read the (GradScaler-scaled) loss and gradients unscaled"
    from backpack.extensions import BatchGrad

    known = set(getattr(BatchGrad(), "_BackpropExtension__module_extensions", {}))
    missing: dict[str, int] = {}
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own and type(module) not in known:
            missing[type(module).__name__] = missing.get(type(module).__name__, 0) + len(own)
    if not missing:
        return None
    why = []
    if "LayerNorm" in missing:
        why.append("BackPACK has no LayerNorm")
    if "MultiheadAttention" in missing:
        why.append("it misses MultiheadAttention's functionally used weights")
    rest = sorted(set(missing) - {"LayerNorm", "MultiheadAttention"})
    if rest:
        why.append("no BackPACK extension for the parameters of " + ", ".join(rest))
    return "; ".join(why) + f" ({sum(missing.values())} parameter tensors without per-sample gradients)"


def attach(arm: Any) -> None:
    """Make ``arm`` a Cockpit arm: extended model and loss, and a backward inside Cockpit's context."""
    from backpack import extend
    from cockpit import Cockpit
    from cockpit.utils import schedules
    from cockpit.utils.configuration import configuration

    warnings.filterwarnings("ignore", module="cockpit")  # "No update step implemented for optimizer" (AdamW): Alpha falls back to caching
    warnings.filterwarnings("ignore", module="backpack")
    warnings.filterwarnings("ignore", message=".*pkg_resources.*")
    extend(arm.model)
    lossfunc = extend(nn.CrossEntropyLoss())
    cp = Cockpit(arm.model.parameters(), quantities=configuration("economy", track_schedule=schedules.linear(EVERY)))
    arm.cockpit = cp

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def backward(loss: torch.Tensor, out: torch.Tensor, y: torch.Tensor) -> None:
        with torch.no_grad():
            losses = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="none")
        info = {"batch_size": out.shape[0], "individual_losses": losses, "loss": loss, "optimizer": arm.opt}
        with cp(arm.global_step, info=info):
            loss.backward(create_graph=cp.create_graph(arm.global_step))

    arm.loss_fn, arm.backward = loss_fn, backward


def logged_quantities(arm: Any) -> list[str]:
    """Names of the Cockpit quantities that produced at least one value during the run."""
    out = arm.cockpit.get_output()
    return sorted({name for per_step in out.values() for name, value in per_step.items() if value is not None})

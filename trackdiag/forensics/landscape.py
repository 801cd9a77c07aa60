"""Loss landscapes along filter-normalised random directions (Li et al., 2018, "Visualizing the
Loss Landscape of Neural Nets").

``loss_landscape(model, batch)`` evaluates the loss of ``model`` on one fixed batch at
``theta + a * d1`` (``dims=1``) or ``theta + a * d1 + b * d2`` (``dims=2``) for ``a, b`` on an
evenly spaced grid over ``[-span, span]``. Each direction is Gaussian, rescaled filter by filter
(row ``i`` of a weight, i.e. output unit/channel ``i``) to the norm of the same filter of the
weights; biases (1-D parameters) and every parameter of a normalisation layer get a zero direction.
Only trainable parameters move.

Guarantees: runs in eval mode under ``torch.no_grad()`` with the RNG state forked; afterwards every
parameter, every buffer (BatchNorm running statistics included) and every module's train/eval flag
is bit-for-bit what it was. Cost: ``steps`` (1-D) or ``steps**2`` (2-D) forward passes of the batch,
capped by ``max_evals``; extra memory three copies of the trainable parameters (the saved weights
and two directions); one host copy of all the losses at the end.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from trackdiag.capture.isolation import rngs_kept
from trackdiag.core.errors import TrackdiagError

log = logging.getLogger("trackdiag")
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"cross_entropy": F.cross_entropy,
                                                                         "mse": F.mse_loss}
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


@dataclass
class Landscape:
    """A computed landscape. ``losses`` is ``[steps]`` (1-D) or ``[steps][steps]`` indexed ``[b][a]``
    (rows: second direction). ``directions`` (not serialised) are the per-parameter directions."""

    dims: int
    alphas: list[float]
    betas: list[float]
    losses: Any
    center_loss: float
    span: float
    seed: int
    evals: int
    seconds: float
    loss: str
    directions: list[list[torch.Tensor]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite losses as strings), directions left out."""
        d = asdict(self)
        d.pop("directions")
        fix = lambda v: v if math.isfinite(v) else str(v)  # noqa: E731
        d["losses"] = [[fix(v) for v in row] for row in self.losses] if self.dims == 2 else [fix(v) for v in self.losses]
        d["center_loss"] = fix(self.center_loss)
        return d


def loss_function(loss: str | Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``cross_entropy`` | ``mse`` | a callable ``(output, target) -> scalar``."""
    if callable(loss):
        return loss
    if loss not in LOSSES:
        raise TrackdiagError(f"landscape loss {loss!r} is not one of {', '.join(LOSSES)}")
    return LOSSES[loss]


def norm_params(model: nn.Module) -> set[int]:
    """ids of the parameters that belong to normalisation layers."""
    return {id(p) for m in model.modules() if isinstance(m, _NORMS) for p in m.parameters(recurse=False)}


@torch.no_grad()
def filter_normalized_direction(params: list[torch.Tensor], generator: torch.Generator,
                                zero: set[int] = frozenset()) -> list[torch.Tensor]:  # type: ignore[assignment]
    """One random direction: for each parameter (in order) a float32 Gaussian drawn on the CPU from
    ``generator`` and, for tensors of 2+ dims, rescaled so each filter ``d[i]`` has the norm of
    ``w[i]``. 1-D parameters and those whose id is in ``zero`` get zeros (still consuming draws)."""
    out = []
    for p in params:
        d = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device)
        if p.dim() <= 1 or id(p) in zero:
            d.zero_()
        else:
            w = p.detach().float().reshape(p.shape[0], -1)
            flat = d.reshape(p.shape[0], -1)
            flat.mul_((w.norm(dim=1) / (flat.norm(dim=1) + 1e-10))[:, None])
        out.append(d.to(p.dtype))
    return out


def _progress(items: Iterable[Any], total: int, show: bool) -> Iterable[Any]:
    """``items`` wrapped in a rich (or tqdm) progress bar when ``show`` and one is installed."""
    if not show:
        return items
    try:
        from rich.progress import track

        return track(items, total=total, description="loss landscape", transient=True)
    except ImportError:
        pass
    try:
        from tqdm import tqdm

        return tqdm(items, total=total, desc="loss landscape", leave=False)
    except ImportError:
        return items


def grid_steps(dims: int, steps: int, max_evals: int | None) -> int:
    """Points per axis: ``steps`` capped so the grid fits ``max_evals``, rounded down to odd
    (so the unperturbed weights are on the grid)."""
    if max_evals is not None:
        steps = min(steps, max_evals if dims == 1 else math.isqrt(max_evals))
    steps = max(steps, 1)
    return steps if steps % 2 else steps - 1


def loss_landscape(model: nn.Module, batch: Any, loss: str | Callable[..., torch.Tensor] = "cross_entropy", *,
                   dims: int = 2, steps: int = 21, span: float = 1.0, max_evals: int | None = None, seed: int = 0,
                   progress: bool = False, evaluate: Callable[[], torch.Tensor] | None = None) -> Landscape:
    """See module docstring. ``batch`` is ``(inputs, targets)``; ``model(inputs)`` is scored by ``loss``.
    ``evaluate()``: the loss at the current weights instead (the user's own loss computation on a
    batch, :mod:`trackdiag.capture.user_loss`; ``batch`` and ``loss`` are then unused)."""
    if dims not in (1, 2):
        raise TrackdiagError(f"landscape dims must be 1 or 2, got {dims!r}")
    user = evaluate is not None
    if evaluate is None:
        if not isinstance(batch, (list, tuple)) or len(batch) < 2:
            raise TrackdiagError(f"landscape needs the batch as (inputs, targets), got {type(batch).__name__}")
        fn = loss_function(loss)
        x, y = batch[0], batch[1]
        evaluate = lambda: fn(model(x), y)  # noqa: E731
    n = grid_steps(dims, steps, max_evals)
    if n != steps:
        log.info("trackdiag: landscape grid %d -> %d points per axis (max_evals=%s, odd)", steps, n, max_evals)
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    if not params:
        raise TrackdiagError("landscape: the model has no trainable parameters")
    alphas = torch.linspace(-span, span, n, dtype=torch.float64).tolist() if n > 1 else [0.0]
    betas = alphas if dims == 2 else [0.0]
    devices = [d.index for d in {p.device for p in params} if d.type == "cuda"]
    gen = torch.Generator().manual_seed(seed)
    zero = norm_params(model)
    training = {m: m.training for m in model.modules()}
    t0 = time.perf_counter()
    with torch.no_grad(), rngs_kept(devices):
        saved = [p.detach().clone() for p in params]
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        dirs = [filter_normalized_direction(params, gen, zero) for _ in range(dims)]
        values = torch.empty(len(betas) * len(alphas), dtype=torch.float64, device=params[0].device)
        try:
            model.eval()
            grid = [(a, b) for b in betas for a in alphas]  # row-major: rows follow the second direction
            for i, (a, b) in enumerate(_progress(grid, len(grid), progress)):
                torch._foreach_copy_(params, saved)
                if a:
                    torch._foreach_add_(params, dirs[0], alpha=a)
                if b:
                    torch._foreach_add_(params, dirs[1], alpha=b)
                values[i] = evaluate().detach().double().reshape(()).to(values.device)
        finally:
            torch._foreach_copy_(params, saved)
            for b, v in buffers:
                b.copy_(v)
            for m, flag in training.items():
                m.training = flag
    host = values.cpu().tolist()  # the one host copy
    losses: Any = host if dims == 1 else [host[r * n : (r + 1) * n] for r in range(len(betas))]
    center = host[(len(host) - 1) // 2]
    name = "loss_fn" if user else loss if isinstance(loss, str) else getattr(loss, "__name__", "custom")
    return Landscape(dims, alphas, betas, losses, center, span, seed, len(host), time.perf_counter() - t0, name, dirs)

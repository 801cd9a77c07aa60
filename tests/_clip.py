"""``clip_grad_norm_`` as a loop calls it, with torch's own arithmetic as the reference.

While a session is open, ``torch.nn.utils.clip_grad_norm_`` may be answered from the gradient tap's norms
(:mod:`trackdiag.capture.clip_serve`), so its return value is no independent reference for the tap's every-step norm.
:func:`clip_checked` takes torch's ``get_total_norm`` of the same gradients first (never served), calls the clip the
loop would call (looked up at call time: a session opened after this module was imported is seen), checks that both
are bitwise equal, and returns torch's.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def clip_checked(params: Any, max_norm: float, call: Callable[..., Any] | None = None) -> torch.Tensor:
    """Clip ``params``' gradients to ``max_norm`` with ``call`` (default: ``torch.nn.utils.clip_grad_norm_`` as it is
    now); returns the pre-clip L2 norm as torch's ``get_total_norm`` computes it, after checking the clip returned
    the same bits."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    grads = [p.grad for p in params if p.grad is not None]
    ref = torch.nn.utils.get_total_norm(grads) if grads else torch.tensor(0.0)
    got = (call or torch.nn.utils.clip_grad_norm_)(params, max_norm)
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    ref = ref.full_tensor() if hasattr(ref, "full_tensor") else ref
    same = torch.equal(got.detach().cpu(), ref.detach().cpu()) or bool(got.isnan() and ref.isnan())
    assert same, f"clip_grad_norm_ returned {float(got)!r}, torch's own norm of the same gradients is {float(ref)!r}"
    return ref

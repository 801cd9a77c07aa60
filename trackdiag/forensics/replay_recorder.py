"""The replay's recorder: every module's forward seen, in execution order, with the finiteness of its
input and output and (for the backward replay) of the gradients flowing through it.

Forwards are seen by wrapping each module's ``forward`` (an instance attribute, removed afterwards),
not by forward hooks: a model whose layers are called as ``layer.forward(x)`` (which skips hooks)
is seen layer by layer too, and a module called the usual way goes through the same wrapper once.
Host reads: one per module and tensor (replay path only).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.capture.layers import ROOT
from trackdiag.util.sparse import finite_flag
from trackdiag.util.tensors import float_tensors


def finite(obj: Any) -> bool:
    """True when no floating tensor in ``obj`` holds a NaN/Inf (one host read per tensor)."""
    return all(bool(finite_flag(t)) for _, t in float_tensors(obj, ""))


def describe(obj: Any) -> str:
    """``"3 NaN and 0 Inf of 640 values"`` for the floating tensors of ``obj`` (host reads)."""
    from trackdiag.util.sparse import stored_values

    ts = [stored_values(t.detach()) for _, t in float_tensors(obj, "")]
    nan = sum(int(torch.isnan(t).sum()) for t in ts)
    inf = sum(int(torch.isinf(t).sum()) for t in ts)
    total = sum(t.numel() for t in ts)
    return f"{nan} NaN and {inf} Inf of {total} values"


class Recorder:
    """Records finiteness through every module of ``model`` while it is installed (see module doc)."""

    def __init__(self, model: nn.Module, backward: bool) -> None:
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
        self.backward = backward
        self.first: tuple[str, bool, str] | None = None  # (module, input finite, description)
        self.order: dict[str, int] = {}
        self.in_ok: dict[str, bool] = {}
        self.grad_out: dict[str, list[torch.Tensor]] = {}
        self.grad_in: dict[str, list[torch.Tensor]] = {}
        self._saved: list[tuple[nn.Module, Any]] = []
        for m in self.names:
            self._saved.append((m, m.__dict__.get("forward")))
            m.__dict__["forward"] = self._wrap(m, m.forward)

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._pre(module, args, kwargs)
            out = forward(*args, **kwargs)
            self._post(module, out)
            return out
        return recorded

    def _grad_hooks(self, store: dict[str, list[torch.Tensor]], name: str, obj: Any) -> None:
        for _, t in float_tensors(obj, ""):
            if t.requires_grad:
                with contextlib.suppress(RuntimeError):
                    t.register_hook(lambda g, n=name: store.setdefault(n, []).append(finite_flag(g)))

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self.names[module]
        self.in_ok.setdefault(name, finite((args, kwargs)))
        if self.backward:
            self._grad_hooks(self.grad_in, name, (args, kwargs))

    def _post(self, module: nn.Module, output: Any) -> None:
        name = self.names[module]
        self.order.setdefault(name, len(self.order))
        if self.first is None and not finite(output):
            self.first = (name, self.in_ok.get(name, True), f"{type(module).__name__}; its output holds {describe(output)}")
        if self.backward:
            self._grad_hooks(self.grad_out, name, output)

    def remove(self) -> None:
        for m, own in self._saved:
            if own is None:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = own
        self._saved.clear()

    def backward_culprit(self, param_ok: dict[str, bool]) -> str | None:
        """Innermost module whose output gradient is finite but input/parameter gradients are not;
        the latest in forward order (the first to run in backward) wins."""
        ok = lambda flags: None if not flags else bool(torch.stack(flags).all())  # noqa: E731
        out_ok = {n: ok(f) for n, f in self.grad_out.items()}
        in_ok = {n: ok(f) for n, f in self.grad_in.items()}
        cands = [n for n in self.order if out_ok.get(n) is not False and (in_ok.get(n) is False or param_ok.get(n) is False)]
        inner = [n for n in cands if not any(c != n and (n == ROOT or c.startswith(n + ".")) for c in cands)]
        if inner:
            return max(inner, key=self.order.__getitem__)
        bad_out = [n for n in self.order if out_ok.get(n) is False]
        return max(bad_out, key=self.order.__getitem__) if bad_out else None

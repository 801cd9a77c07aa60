"""The replay's recorder: every module's forward seen, in execution order, with the finiteness of its
input and output and (for the backward replay) of the gradients flowing through it.

Forwards are seen by wrapping each module's ``forward`` (an instance attribute, removed afterwards),
not by forward hooks alone: a model whose layers are called as ``layer.forward(x)`` (which skips hooks)
is seen layer by layer too, and a module called the usual way goes through the same wrapper once.
A module's output is judged as its caller sees it: for a call through ``module(x)`` that is after the
module's own forward hooks, which may return a replacement (activation steering, pruning or
quantisation observers, the user's hooks), so the recorder's own forward hook, registered last on
every module for the replay, judges it there; a ``layer.forward(x)`` call (no hook runs) is judged
when its forward returns. When a hook's replacement is the first non-finite output, the description
says that the forward's own output was finite.
Host reads: one per module and tensor (replay path only); one Python hook call per module call.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.capture.layers import ROOT
from trackdiag.util.sparse import finite_flag
from trackdiag.util.tensors import float_tensors

#: the code of ``Module._call_impl`` and of the functions nested in it (torch runs the hooked path in one):
#: a forward called from them is followed by the module's forward hooks
_CALL_IMPL = frozenset([nn.Module._call_impl.__code__, *(c for c in nn.Module._call_impl.__code__.co_consts
                                                        if isinstance(c, type(nn.Module._call_impl.__code__)))])


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
        self._handles: list[Any] = []
        # (module, its forward's own output) between the forward's return and the recorder's hook (a stack:
        # a hook may call other modules)
        self._hooked: list[tuple[nn.Module, Any]] = []
        self._hooked_on: set[nn.Module] = set()  # the modules the recorder's hook is registered on
        for m in self.names:
            self._saved.append((m, m.__dict__.get("forward")))
            m.__dict__["forward"] = self._wrap(m, m.forward)
            with contextlib.suppress(RuntimeError, TypeError, AttributeError):  # no hook taken: judged at once
                self._handles.append(m.register_forward_hook(self._after_hooks))  # appended: runs after the user's
                self._hooked_on.add(m)

    def _wrap(self, module: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            self._pre(module, args, kwargs)
            out = forward(*args, **kwargs)
            if module in self._hooked_on and sys._getframe(1).f_code in _CALL_IMPL:  # module(x): after its hooks
                self._hooked.append((module, out))
            else:  # module.forward(x): no hook runs, the caller gets this
                self._post(module, out)
            return out
        return recorded

    def _after_hooks(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """The recorder's forward hook (the module's last): ``output`` is what the caller gets."""
        if self._hooked and self._hooked[-1][0] is module:
            _, own = self._hooked.pop()
            self._post(module, output, own)

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

    def _post(self, module: nn.Module, output: Any, own: Any = None) -> None:
        """``output`` as the caller sees it; ``own``: the forward's own output when a forward hook may have
        replaced it (read only when ``output`` is the first non-finite one)."""
        name = self.names[module]
        self.order.setdefault(name, len(self.order))
        if self.first is None and not finite(output):
            desc = f"{type(module).__name__}; its output holds {describe(output)}"
            if own is not None and own is not output and finite(own):
                desc += "; its forward's own output was finite: a forward hook registered on it returned the non-finite one"
            self.first = (name, self.in_ok.get(name, True), desc)
        if self.backward:
            self._grad_hooks(self.grad_out, name, output)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._hooked.clear()
        self._hooked_on.clear()
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

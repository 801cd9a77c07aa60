"""What the gradient tap (:mod:`trackdiag.capture.gradtap`) leaves for the probes: a backward pass's
measurements (:class:`Tap`, their every-step norms worked out a window at a time by :func:`totals`),
the sentinel's record of each pass (:class:`Pass`), and the view a step's gradient probes read
(:class:`GradView`). Device tensors only; nothing here reads the host.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from trackdiag.capture.context import Component
from trackdiag.util.norms import fp32_norm, grad_norms, plain

#: a tensor's version counter (``list(map(VERSION, tensors))``: one C-level pass, no frame per tensor)
VERSION = operator.attrgetter("_version")


@dataclass(slots=True)
class Tap:
    """What one backward pass left in one component's gradients.

    total: the global L2 norm (0-d fp32 device tensor, unscaled); on a plain step it is worked out from
        ``parts`` when first asked for (the every-step series asks for a whole window at once:
        :func:`totals`), so a step pays one kernel for it, not three.
    norms: per-parameter L2 norms (fp32, unscaled, ``comp.index.params`` order), on detail steps, else None.
    max_abs: the largest gradient magnitude (0-d, unscaled), on detail steps, else None.
    versions / ids: the gradients' version counters and identities, on detail steps, else None.
    step: the optimizer step in progress; number: the backward pass's running number.
    sentinel: the L2 norm of the sentinel parameter's gradient (0-d fp32, unscaled), or None: what
        the step's optimizer finds left of it tells whether the gradients were wiped before it ran.
    """

    total_: torch.Tensor | None
    norms: torch.Tensor | None
    step: int
    number: int
    generation: int = 0
    max_abs: torch.Tensor | None = None
    versions: list[int] | None = None
    ids: list[int] | None = None
    sentinel: torch.Tensor | None = None
    #: the sentinel's gradient tensor and its version counter when measured: the same tensor at the same
    #: version at the optimizer step means nothing touched it in between (no kernel needed to tell)
    sentinel_grad: torch.Tensor | None = None
    sentinel_version: int = -1
    #: the per-tensor norms (``_foreach_norm``'s list, scaled) when ``total`` is not worked out yet
    parts: list[torch.Tensor] | None = None
    scale: torch.Tensor | None = None
    #: the gradients measured and their version counters, kept (with ``parts``) on a pass that took ``_foreach_norm``
    #: for a component whose parameters the loop clips: what :mod:`~trackdiag.capture.clip_serve` checks before it
    #: answers ``clip_grad_norm_`` from ``parts``
    grads: list[torch.Tensor] | None = None
    grad_versions: list[int] | None = None

    @property
    def total(self) -> torch.Tensor:
        if self.total_ is None:
            self.total_ = totals([(self.parts, self.scale)])[0] if self.parts is not None else torch.zeros(())
            self.parts = None
        return self.total_

    def lazy(self) -> tuple[list[torch.Tensor] | None, torch.Tensor | None] | torch.Tensor:
        """What the every-step series keeps of this pass: the total when known, else (parts, scale)."""
        return self.total_ if self.total_ is not None else (self.parts, self.scale)


def totals(items: list[Any]) -> torch.Tensor:
    """Global norms of several passes as one 1-D fp32 tensor, in order: each item a total (0-d) or the
    ``(parts, scale)`` of a pass whose total is not worked out yet. Passes with the same number of
    tensors share one ``stack`` and one norm (a window of steps: 2-3 kernels, not 2 per step)."""
    if len(items) == 1 and isinstance(items[0], tuple):  # one pass (``Tap.total``): a stack and a norm, no graph
        parts, scale = items[0]
        stacked = torch.stack(parts)
        one = torch.linalg.vector_norm(stacked if stacked.dtype is torch.float32 else stacked.float()).reshape(1)
        return one / scale if scale is not None else one
    lazy: dict[int, list[int]] = {}
    done: list[int] = []
    for i, it in enumerate(items):
        if isinstance(it, tuple):
            lazy.setdefault(len(it[0]), []).append(i)
        else:
            done.append(i)
    chunks: list[torch.Tensor] = []
    order: list[int] = []
    with torch.no_grad():  # a context manager: a KeyboardInterrupt anywhere in here cannot leave grad mode off
        for n, idx in lazy.items():
            flat = torch.stack([p for i in idx for p in items[i][0]]).float().view(len(idx), n)
            tot = torch.linalg.vector_norm(flat, dim=1)
            scales = [items[i][1] for i in idx]
            if any(s is not None for s in scales):
                tot = tot / torch.stack([s if s is not None else torch.ones((), device=tot.device) for s in scales])
            chunks.append(tot)
            order += idx
        if done:
            chunks.append(torch.stack([items[i].reshape(()).float() for i in done]))
            order += done
        out = chunks[0] if len(chunks) == 1 else torch.cat([c.to(chunks[0].device) for c in chunks])
    if order != list(range(len(items))):
        where = [0] * len(order)
        for pos, i in enumerate(order):
            where[i] = pos
        out = out[torch.tensor(where, device=out.device)]
    return out


def merge_taps(first: Tap, later: Tap, mask: torch.Tensor) -> Tap | None:
    """The step's gradients when some of a component's parameters were stepped after a backward pass of
    their own: per parameter, ``later``'s norm where ``mask`` (a bool tensor over ``comp.index.params``),
    else ``first``'s; their global norm. None when a pass kept no per-parameter norms (the tap keeps them for
    components with several optimizers) or the two cover different parameters. Version counters are not
    carried (what clipped what is not known)."""
    a, b = first.norms, later.norms
    if a is None or b is None or a.shape != b.shape or first.generation != later.generation:
        return None
    with torch.no_grad():
        norms = torch.where(mask.to(a.device), b.to(a.device), a)
        top = torch.maximum(first.max_abs, later.max_abs) if first.max_abs is not None and later.max_abs is not None else None
        return Tap(torch.linalg.vector_norm(norms), norms, first.step, later.number, first.generation, top,
                   sentinel=first.sentinel, sentinel_grad=first.sentinel_grad, sentinel_version=first.sentinel_version)


@dataclass(slots=True)
class Pass:
    """One backward pass as the sentinel saw it: was its gradient reset before the pass
    (``True`` on the host for ``None``, else a device bool for "all zero"), the sentinel
    parameter's version counter (it changes when the parameters are updated in place, unless through ``.data``), and whether
    the pass before it had left a non-zero gradient (an all-zero gradient after a pass that
    contributed exactly zero, a dead unit's, is no sign of a reset)."""

    reset: bool | torch.Tensor
    param_version: int
    #: True, or a device tensor that is non-zero exactly when that gradient was (the sentinel's L2 norm)
    prev_nonzero: bool | torch.Tensor = True
    #: the sentinel parameter's sum when the pass reached it (0-d fp32, device), for a component no optimizer
    #: steps: a hand-written update through ``p.data`` (``p.data -= lr * p.grad``) leaves the version counter
    #: as it was, so only the values tell that the parameters changed between two passes; else None
    value: torch.Tensor | None = None


def sentinel_norm(g: torch.Tensor) -> torch.Tensor:
    """The L2 norm of the sentinel's gradient (0-d fp32, no autograd graph): one kernel. 0 exactly when
    every value is (short of values below ~4e-23, whose squares underflow: no gradient a step uses)."""
    return fp32_norm(plain(g.detach() if g.requires_grad else g))


def foreach_norms(grads: list[torch.Tensor], low_precision: bool) -> tuple[torch.Tensor, ...]:
    """The per-tensor L2 norms in one kernel (fp32 for low-precision gradients); raises what
    ``_foreach_norm`` raises for gradients it refuses (sparse, mixed)."""
    return torch._foreach_norm(grads, 2, dtype=torch.float32) if low_precision else torch._foreach_norm(grads)


def sentinel_raw(comp: Component, grads: list[torch.Tensor], parts: Any, sentinel: torch.Tensor) -> torch.Tensor:
    """The raw L2 norm of ``sentinel``'s gradient (0-d fp32): taken from the per-tensor norms ``parts`` when
    they hold it (no extra kernel), else :func:`sentinel_norm`."""
    g = sentinel.grad
    at = comp.index.position(sentinel) if parts is not None else None
    raw = parts[at] if at is not None and grads[at] is g else sentinel_norm(g)
    return raw if raw.dtype is torch.float32 else raw.float()


def plain_tap(comp: Component, grads: list[torch.Tensor], step: int, number: int,
              sentinel: torch.Tensor | None, keep: bool = False) -> Tap | None:
    """The measurement of a plain pass (no detail due, one optimizer, no scaler, a few tensors on one device; see
    :meth:`~trackdiag.capture.gradtap.GradTap.measure`): the per-tensor norms (one ``_foreach_norm``) kept for
    :func:`totals`, the sentinel's norm one of them. One kernel, no host read; None when the kernel refuses these
    gradients (sparse, mixed): the caller takes the general way. ``keep``: the loop clips this component's
    gradients, so the pass also keeps them and their version counters (``Tap.grads``, a C-level pass)."""
    grad_mode = torch.is_grad_enabled()  # a create_graph backward: no graph for these norms
    try:
        torch._C._set_grad_enabled(False)
        parts = torch._foreach_norm(grads, 2, dtype=torch.float32) if comp.index.low_precision else \
            torch._foreach_norm(grads)  # foreach_norms inline: a frame less on every plain step
    except (RuntimeError, NotImplementedError):
        return None
    finally:
        torch._C._set_grad_enabled(grad_mode)
    tap = Tap(None, None, step, number, comp.generation, parts=parts)
    if keep:
        tap.grads, tap.grad_versions = grads, list(map(VERSION, grads))
    g = sentinel.grad if sentinel is not None else None
    if g is not None:
        tap.sentinel = sentinel_raw(comp, grads, parts, sentinel)
        tap.sentinel_grad, tap.sentinel_version = g, g._version
    return tap


@dataclass(slots=True)
class GradView:
    """A component's gradients at the moment a step consumes them (what gradient probes read).

    ``tap``: the measurements; ``source``: ``"backward"`` (taken at the end of the backward pass,
    before any clipping or unscaling: the *pre-clip* values) or ``"step"`` (read at consumption: no
    backward pass reached the component since the last step, or the tap is off). ``stepped``: an
    optimizer step consumed them (False in a loop without an optimizer, or when the optimizer did
    not step). ``passes``: the backward passes the sentinel saw since the previous step.
    """

    comp: Component
    tap: Tap
    source: str
    stepped: bool
    passes: list[Pass] = field(default_factory=list)
    sentinel: torch.Tensor | None = None  # the parameter whose gradient ``tap.sentinel`` measured
    _now: torch.Tensor | None = None

    @property
    def total(self) -> torch.Tensor:
        """The global L2 norm, pre-clip and unscaled (0-d fp32, device)."""
        return self.tap.total

    @property
    def norms(self) -> torch.Tensor:
        """Per-parameter L2 norms, pre-clip and unscaled (fp32, device): taken on detail steps (the due
        steps of gradient probes); elsewhere computed now, from the gradients as they are now."""
        if self.tap.norms is None:
            self.tap.norms = grad_norms(self.comp.index.grads(), self.comp.index.low_precision)
        return self.tap.norms

    def modified(self) -> bool | None:
        """Whether the gradients changed since they were measured (``clip_grad_norm_``,
        ``scaler.unscale_``, replaced); None when not known (no version counters on this step)."""
        if self.source != "backward":
            return False
        if self.tap.versions is None:
            return None
        grads = self.comp.index.grads()
        return [g._version for g in grads] != self.tap.versions or [id(g) for g in grads] != self.tap.ids

    @torch.no_grad()
    def now_norms(self) -> torch.Tensor:
        """Per-parameter norms of the gradients as the optimizer sees them (after clipping):
        the pre-clip norms when nothing changed them, else one more ``_foreach_norm``."""
        if self._now is None:
            self._now = self.norms
            if self.modified():
                self._now = grad_norms(self.comp.index.grads(), self.comp.index.low_precision)
        return self._now

"""The user's ``clip_grad_norm_`` answered from the norms the gradient tap took: one read of the gradients a step, not two.

The every-step gradient norm reads every gradient once, at the end of the backward pass (:mod:`~trackdiag.capture.
gradtap`). A loop that clips then calls ``torch.nn.utils.clip_grad_norm_``, which reads every gradient again for the
same per-tensor norms (nanoGPT, Hugging Face's Trainer and accelerate, Lightning's ``gradient_clip_val``, the RNN and
RL examples of pytorch/examples). While a session is open, ``torch.nn.utils.clip_grad_norm_`` is :func:`clip_grad_norm_`
here: when the gradients it is given are exactly those the tap measured (the same tensors at the same version
counters: nothing wrote to them since), it stacks the tap's per-tensor norms in the caller's order and takes their
norm, the very ops and order of torch's own ``_get_total_norm`` (per-tensor ``_foreach_norm``, ``stack``,
``vector_norm``), then clips with torch's ``clip_grads_with_norm_``: the clipped gradients and the returned norm are
bitwise those of torch's function (``tests/test_clip_serve.py`` trains with and without a session and compares
every weight). Anything else goes to torch's function unchanged: another norm type, ``error_if_nonfinite``,
``foreach`` given (torch decides by it; the tap's kernel is the one ``foreach=None`` picks), half-precision or sharded
gradients, a component with half-precision parameters, a ``GradScaler`` (the tap's norms are unscaled), gradients
changed since the pass (``scaler.unscale_``, ``nan_to_num_``, ``clip_grad_value_``), parameters of two components or
of none, a pass measured another way (more than 64 tensors on the CPU off detail steps, several optimizers),
``torch.compile`` tracing, a caller that bound torch's function before the session opened.

A component is *armed* the first time a call covers some of its parameters; from the next backward pass on its
measurement keeps the per-tensor norms, the gradients' list and their version counters (a C-level pass, ~0.1 us a
tensor), on plain and detail steps alike (off the CPU, a model of any number of tensors). When the call's parameters
are all of the component's measured gradients, its norm is the step's every-step norm too.

Cost per served call: a few C-level passes over the parameters and 2 ops (``stack``, ``vector_norm``) instead of
the per-tensor norms of every gradient.
"""
from __future__ import annotations

import functools
import operator
import threading
import types
from typing import Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as _clip_mod

from trackdiag.capture.grad_records import VERSION
from trackdiag.capture.tap_hooks import TAP_QUEUE

#: torch's own function, as it was when trackdiag was imported (the one every unserved call goes to)
TORCH_CLIP = _clip_mod.clip_grad_norm_
DTYPE, LAYOUT = operator.attrgetter("dtype"), operator.attrgetter("layout")
_TENSOR, _FP32, _STRIDED = {torch.Tensor}, {torch.float32}, {torch.strided}
_lock = threading.Lock()
_installed = False


class Entry:
    """Where a parameter list's gradients sit in one component's tap: the component's tap state, the parameters'
    positions in its index (and a C-level getter of them), the generation they were found in."""

    __slots__ = ("st", "positions", "top", "generation", "pick")

    def __init__(self, st: Any, positions: tuple[int, ...], generation: int) -> None:
        self.st, self.positions, self.generation = st, positions, generation
        self.top = max(positions)  # the measured list must reach this far
        one = operator.itemgetter(*positions)
        self.pick = one if len(positions) > 1 else (lambda seq: (one(seq),))


#: (ids of a call's parameters that have a gradient) -> Entry, or None for "no component holds them all"
_entries: dict[tuple[int, ...], Entry | None] = {}
MAX_ENTRIES = 16
#: calls served and calls passed to torch's function since the process started (tests and benchmarks read them)
counts = {"served": 0, "torch": 0}


def _find(params: list[torch.Tensor], key: tuple[int, ...]) -> Entry | None:
    """The component whose index holds every one of ``params`` (host work, once per parameter list and generation);
    arms it (its measurements keep their per-tensor norms, the gradients and their versions from now on)."""
    for tap in list(TAP_QUEUE.taps):
        for st in tap.states.values():
            idx = st.comp.index
            if idx.low_precision:  # its norms are taken in fp32 (torch's clip: in the gradients' dtype)
                continue
            pos = [idx.position(p) for p in params]
            if pos and None not in pos and len(set(pos)) == len(pos):
                st.clip_armed = True
                return Entry(st, tuple(pos), st.comp.generation)
    return None


def _plain_fp32(grads: list[torch.Tensor]) -> bool:
    """Every gradient a plain strided fp32 tensor (no subclass: DTensor, no sparse): C-level passes, no frame per tensor."""
    return (set(map(type, grads)) == _TENSOR and set(map(DTYPE, grads)) == _FP32
            and set(map(LAYOUT, grads)) == _STRIDED)


def _total(params: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The norm torch's clip would compute, from the tap's per-tensor norms; None when ``grads`` are not exactly the
    gradients the pass measured. No side effect on the gradients (the clip is the caller's, after this returns)."""
    key = tuple(map(id, params))
    entry = _entries.get(key, False)
    if entry is False:
        entry = _find(params, key)
        if len(_entries) >= MAX_ENTRIES:
            _entries.pop(next(iter(_entries)))
        _entries[key] = entry
    if entry is None:
        return None
    st = entry.st
    tap = st.latest
    if entry.generation != st.comp.generation:
        _entries.pop(key, None)  # re-indexed: found again at the next call
        return None
    if (tap is None or tap.grads is None or tap.parts is None or tap.scale is not None
            or tap.generation != entry.generation or len(tap.grads) <= entry.top):
        return None
    pick = entry.pick
    if not all(map(operator.is_, grads, pick(tap.grads))) or list(map(VERSION, grads)) != list(pick(tap.grad_versions)):
        return None  # not the gradients the pass left, or written to since
    first = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in pick(tap.parts)]), 2.0)
    if len(entry.positions) == len(tap.grads):  # every gradient the pass measured: the step's norm is this one
        tap.total_, tap.parts = total, None
    return total


@functools.wraps(TORCH_CLIP)
def clip_grad_norm_(parameters: Any, max_norm: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, answered from the gradient tap's norms where they are exactly what torch's
    would compute (see the module docstring); otherwise torch's own."""
    if torch.compiler.is_compiling():  # traced: torch's own (nothing here is looked at, so no guard on it)
        return TORCH_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if not TAP_QUEUE.taps or TAP_QUEUE.paused or error_if_nonfinite or foreach is not None or norm_type != 2.0 \
            or isinstance(norm_type, bool):
        counts["torch"] += 1
        return TORCH_CLIP(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    else:
        params = list(parameters)
        if not params:  # torch's function says so for an empty generator: hand it one
            counts["torch"] += 1
            return TORCH_CLIP((p for p in ()) if isinstance(parameters, types.GeneratorType) else params, max_norm,
                              norm_type, error_if_nonfinite, foreach)
    try:
        with torch.no_grad():
            grads = [p.grad for p in params if p.grad is not None]
            with_grads = params if len(grads) == len(params) else [p for p in params if p.grad is not None]
            total = _total(with_grads, grads) if grads and _plain_fp32(grads) else None
    except Exception:  # noqa: BLE001 - never fail the user's clip: torch's function decides
        total = None
    if total is None:
        counts["torch"] += 1
        return TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    counts["served"] += 1
    torch.nn.utils.clip_grads_with_norm_(with_grads, max_norm, total, foreach)  # torch's second half, as torch's own
    return total


def forget(states: Any) -> None:
    """A tap detached: its components' entries go (an entry would keep a closed session's model alive)."""
    gone = {id(st) for st in states}
    with _lock:
        for key in [k for k, e in _entries.items() if e is not None and id(e.st) in gone]:
            del _entries[key]


def install() -> None:
    """Put :func:`clip_grad_norm_` where loops look ``torch.nn.utils.clip_grad_norm_`` up (once per process; while no
    session is open it is torch's function with one test in front)."""
    global _installed
    with _lock:
        if _installed:
            return
        for mod in (torch.nn.utils, _clip_mod):
            if getattr(mod, "clip_grad_norm_", None) is TORCH_CLIP:
                mod.clip_grad_norm_ = clip_grad_norm_
        _installed = True


def uninstall() -> None:
    """Torch's function back (where :func:`install` put this one and nobody replaced it since)."""
    global _installed
    with _lock:
        for mod in (torch.nn.utils, _clip_mod):
            if getattr(mod, "clip_grad_norm_", None) is clip_grad_norm_:
                mod.clip_grad_norm_ = TORCH_CLIP
        _entries.clear()
        _installed = False

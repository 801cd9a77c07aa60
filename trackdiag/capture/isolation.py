"""Forwards trackdiag runs itself (replays, model summary, activation sampling) leave no trace.

``isolated(model)`` restores, on exit, every buffer (BatchNorm statistics and batch counters,
quantisation observers), every module's ``training`` flag and plain attributes (numbers, strings,
flags: a module's own step counter), and the RNG state (dropout draws); inside it compiled code
runs eagerly (``torch.compile``'s ``force_eager`` stance: hooks are seen, nothing is traced or
recompiled) and the gradient tap does not count the backward passes. Cost: one copy of the buffers
and a host pass over the modules' attributes, per isolated forward. :func:`rngs_kept` keeps every global random
generator a user's forward may draw from (torch's, Python's ``random``, NumPy's), for the pre-flight and
landscapes too; :func:`generators_kept` the ``torch.Generator`` objects passed to a forward trackdiag re-runs.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

PLAIN = (bool, int, float, str, bytes, type(None))


def eager() -> contextlib.AbstractContextManager[Any]:
    """Compiled code runs eagerly inside (hooks are seen, nothing is traced or recompiled)."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


def plain_state(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Each module's plain attributes (numbers, strings, None: step counters, flags)."""
    return [(m, {k: v for k, v in vars(m).items() if isinstance(v, PLAIN)}) for m in model.modules()]


def restore_plain_state(saved: list[tuple[nn.Module, dict[str, Any]]]) -> None:
    for m, attrs in saved:
        for k, v in attrs.items():
            if vars(m).get(k, v) is not v:
                object.__setattr__(m, k, v)


@contextlib.contextmanager
def rngs_kept(devices: list[int]) -> Iterator[None]:
    """torch's CPU and CUDA (``devices``) generators, Python's ``random`` and NumPy's global generator, as they were
    on entry, restored on exit: a forward that draws noise from any of them (``random.random()`` for scheduled
    sampling, ``np.random`` augmentation) re-run by trackdiag leaves the run's own draws unchanged."""
    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def generators_in(*holders: Any, depth: int = 3) -> list[torch.Generator]:
    """The ``torch.Generator`` objects among ``holders`` and inside their tuples, lists and dicts (``depth``
    levels): a forward's own generator (scheduled sampling's coin flips drawn with ``generator=gen``)."""
    found: list[torch.Generator] = []
    for obj in holders:
        if isinstance(obj, torch.Generator):
            found.append(obj)
        elif depth and isinstance(obj, (tuple, list)):
            found += generators_in(*obj, depth=depth - 1)
        elif depth and isinstance(obj, dict):
            found += generators_in(*obj.values(), depth=depth - 1)
    return list({id(g): g for g in found}.values())


@contextlib.contextmanager
def generators_kept(generators: list[torch.Generator]) -> Iterator[None]:
    """``generators`` as they were on entry, restored on exit: a forward trackdiag re-runs with the step's own
    arguments (the pre-flight, the NaN replay) does not advance the generator the user passed to it, so the run
    draws what it would have drawn without trackdiag."""
    states = [(g, g.get_state()) for g in generators]
    try:
        yield
    finally:
        for g, state in states:
            g.set_state(state)


def replaying(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    """``call(fn)``: ``fn(*args, **kwargs)`` with the generators among the arguments put back afterwards (a
    forward of the step re-run by trackdiag with its captured arguments); they are looked for once, here."""
    kept = generators_in(args, kwargs)

    def call(fn: Callable[..., Any]) -> Any:
        with generators_kept(kept):
            return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def isolated(model: nn.Module) -> Iterator[None]:
    """See module docstring."""
    from trackdiag.capture.gradtap import TAP_QUEUE

    training = {m: m.training for m in model.modules()}
    plain = plain_state(model)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    try:
        with TAP_QUEUE.pause(), eager(), rngs_kept(devices):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for m, flag in training.items():
            m.training = flag
        restore_plain_state(plain)

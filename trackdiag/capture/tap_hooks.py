"""The gradient tap's hooks (see :mod:`trackdiag.capture.gradtap` for the whole): a tensor hook on the trainable
parameters of each component, one per built-in layer (:func:`firing`), tells that a backward pass reached
it and queues one end-of-backward callback per pass (:data:`TAP_QUEUE`; under ``torch.distributed`` twice
removed, after DDP's and FSDP's own end-of-backward work). One parameter per component, the *sentinel*
(:func:`pick_sentinel`), also records per pass whether its gradient was reset before the pass accumulated
into it and whether the pass really accumulated (a ``Pass``, what the zero-grad verdicts are made of).

Cost per backward pass: one Python call per hooked parameter that receives a gradient (~0.3-1 us); on the
sentinel, one all-zero test (2 small ops) when its gradient was not ``None``, and for a component that no
optimizer steps one ``sum`` of its values (a hand-written ``p.data`` update leaves no other trace). No host read.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from trackdiag.capture.context import Component
from trackdiag.capture.grad_records import Pass, Tap, sentinel_norm


@dataclass
class CompTap:
    """Per-component state of the tap."""

    comp: Component
    generation: int = -1
    fired: bool = False
    latest: Tap | None = None  # the most recent backward's measurements
    first_in_step: Tap | None = None  # the first backward inside a closure-stepped ``step()``
    in_closure: bool = False
    passes: list[Pass] = field(default_factory=list)  # backward passes since the gradients were last consumed
    count: int = 0
    handles: list[Any] = field(default_factory=list)
    sentinel: torch.Tensor | None = None
    pending: Pass | None = None  # seen by the sentinel's tensor hook, kept once accumulated into .grad
    last_nonzero: bool | torch.Tensor = True  # the sentinel's gradient after the last pass: its L2 norm (0: all zero)
    saw: bool = False  # the sentinel's hook ran in the backward pass in progress
    misses: int = 0  # backward passes in a row that reached the component but not its sentinel
    params_of: dict[int, tuple[int, ...]] = field(default_factory=dict)  # generation -> the ids it measured, in order
    #: the per-layer hooks (not the sentinel's): dropped once the sentinel has stood for them (see thin())
    layer_handles: list[Any] = field(default_factory=list)
    fires: int = 0  # hooks run in the backward pass in progress
    whole: int = 0  # backward passes in a row in which every hook ran, the sentinel's too
    thin: bool = False  # only the sentinel's hooks are on
    clip_armed: bool = False  # the loop clips these gradients with clip_grad_norm_ (capture.clip_serve)
    #: a sentinel that replaced one the passes stopped reaching (GradTap._follow_sentinel), not yet reached: its first
    #: pass may follow earlier passes of the same step (accumulation), so its gradient tells nothing of a reset
    switched: bool = False

    def fire(self, _grad: torch.Tensor) -> None:
        """Tensor hook on every parameter: note that this backward reaches the component."""
        if TAP_QUEUE.paused:
            return None
        self.fires += 1
        if not self.fired:
            self.fired = True
            TAP_QUEUE.arm()
        return None

    def passed(self) -> bool:
        """At the end of a backward pass that reached the component: count it toward :meth:`thin` (a pass in which
        every hook ran exactly once, the sentinel's too); True when the per-layer hooks should now go."""
        whole = not self.thin and self.saw and self.fires == len(self.layer_handles) + 1
        self.fires = 0
        self.whole = self.whole + 1 if whole else 0
        return self.whole >= THIN_AFTER

    def thin_out(self) -> None:
        """The sentinel has been reached by every backward pass that reached the component, :data:`THIN_AFTER` in a
        row: its hook alone tells that a pass reached the component, so the per-layer hooks are removed (a Python
        call per layer and pass saved: ~3 us each on a CPU). A step whose optimizer finds no measured pass puts
        them back (:meth:`~trackdiag.capture.gradtap.GradTap.take`)."""
        for h in self.layer_handles:
            h.remove()
        self.layer_handles.clear()
        self.thin = True

    def watch(self, _grad: torch.Tensor) -> None:
        """Tensor hook on the sentinel: was its gradient reset before this pass accumulates?"""
        p = self.sentinel
        if p is not None and not TAP_QUEUE.paused:
            g = p.grad
            if g is None or self.switched:
                reset: bool | torch.Tensor = True
                self.switched = False
            elif g.layout is torch.strided:
                reset = sentinel_norm(g) == 0  # all zero (two small ops; none in a set_to_none loop)
            else:
                reset = torch.tensor(g._nnz() == 0)
            # no optimizer: updates are hand-written, often through ``p.data`` (no version bump): keep the values' sum
            value = None if self.comp.optimizers or p.layout is not torch.strided else p.detach().sum(dtype=torch.float32)
            self.pending = Pass(reset, p._version, self.last_nonzero, value)
            self.saw = True
            self.fires += 1  # fire() inline: a frame less on every backward pass
            if not self.fired:
                self.fired = True
                TAP_QUEUE.arm()
            return None
        return self.fire(_grad)

    def accumulated(self, _param: torch.Tensor) -> None:
        """Post-accumulate hook on the sentinel: the pass really added into ``.grad`` (not a
        ``torch.autograd.grad`` call, which computes gradients without accumulating them). Whether
        the pass left a non-zero gradient is read at the end of the backward pass, from the sentinel's
        norm taken there anyway (:meth:`GradTap.end_of_backward`): no device op here."""
        if self.pending is not None:
            self.passes.append(self.pending)
            self.pending = None
            del self.passes[:-64]  # bounded: a loop that never steps


class _Queue:
    """Queues the end-of-backward callback once per backward pass, for every live tap."""

    def __init__(self) -> None:
        self.taps: list[Any] = []  # the GradTaps (capture.gradtap) this queue serves
        self.queued = False
        self.paused = False  # trackdiag's own replays and pre-flight: not the user's backward passes

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Backward passes trackdiag runs itself (replays, landscapes) are not measured."""
        before = self.paused
        try:  # set inside the try: a KeyboardInterrupt right after it must not leave the taps paused
            self.paused = True
            yield
        finally:
            self.paused = before

    def arm(self) -> None:
        if self.queued:
            return
        self.queued = True
        # is a process group up? _distributed()'s answer read off torch's one world object (its three frames a pass)
        up = _WORLD._default_pg is not None if _WORLD is not None else _distributed()
        try:  # DDP/FSDP queue their own end-of-backward work: run after it (twice removed); else at once
            torch.autograd.Variable._execution_engine.queue_callback(self._again if up else self._end)
        except Exception:  # noqa: BLE001 - not inside the engine: measured at the step instead
            self.queued = False

    def _again(self) -> None:
        # queued from a callback: runs after the callbacks DDP/FSDP queued during the pass
        torch.autograd.Variable._execution_engine.queue_callback(self._end)

    def _end(self) -> None:
        self.queued = False
        for tap in list(self.taps):
            tap.end_of_backward()


TAP_QUEUE = _Queue()

#: backward passes in a row, each reaching every hooked layer of a component and its sentinel, after which the
#: sentinel's hook alone stands for the component's (CompTap.thin_out)
THIN_AFTER = 20



def _distributed() -> bool:
    """Whether a process group is up (DDP/FSDP wrappers need one)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _world() -> Any:
    """torch's process-group registry, whose ``_default_pg`` ``torch.distributed.is_initialized()`` reads (through a
    metaclass property and a property: three frames), or None when this torch has no such object."""
    try:
        from torch.distributed import distributed_c10d
    except ImportError:  # a torch built without distributed support
        return None
    world = getattr(distributed_c10d, "_world", None)
    return world if world is not None and hasattr(world, "_default_pg") else None


_WORLD = _world()


def firing(model: Any, params: list[torch.Tensor], sentinel: torch.Tensor | None) -> set[int]:
    """The ids of the parameters whose hook tells that a backward pass reached the component: every
    trainable parameter, except that of a built-in ``torch.nn`` layer's own parameters (a Linear's weight and bias, a
    GRU's four tensors: its forward uses them all, so a pass reaches all or none) one stands for the rest:
    the sentinel when it is one of them. Host work, at attach time."""
    ids = {id(p) for p in params}
    if not isinstance(model, torch.nn.Module):
        return ids
    keep: set[int] = set()
    spare: set[int] = set()
    for m in model.modules():
        if not type(m).__module__.startswith("torch.nn.modules."):
            continue
        own = [p for p in m._parameters.values() if p is not None and id(p) in ids]
        if len(own) > 1:
            first = sentinel if any(p is sentinel for p in own) else own[0]
            keep.add(id(first))
            spare.update(id(p) for p in own if p is not first)
    return ids - (spare - keep)


def watched(comp: Component) -> list[torch.Tensor]:
    """The parameters of ``comp`` whose gradients the tap hooks: those that require a gradient now. When none does
    but an optimizer holds some, all of those: a component frozen at every ``step()`` and trained in a phase of its
    own (a GAN's discriminator, ``requires_grad`` turned off for the generator's step and on again for its own: the
    igul222 and CycleGAN loops) would otherwise never be hooked, and a ``zero_grad`` it misses never seen."""
    live = [p for p in comp.index.params if p.requires_grad]
    if live or not comp.optimizers:
        return live
    return [p for p in comp.index.params if p.is_floating_point() or p.is_complex()]


@contextlib.contextmanager
def hookable(params: list[torch.Tensor]) -> Iterator[None]:
    """``requires_grad`` on for the frozen ones of ``params`` while their hooks are registered (PyTorch refuses a hook
    on a tensor that does not require a gradient; the hook stays when it is turned off again). Host work, outside any
    forward or backward pass."""
    off = [p for p in params if not p.requires_grad]
    for p in off:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in off:
            p.requires_grad_(False)


def pick_sentinel(comp: Component) -> torch.Tensor | None:
    """The parameter whose gradient stands for the component's in the zero-grad checks: the
    smallest watched tensor (:func:`watched`) of the first or the last layer (every backward pass through the
    component reaches those; the smallest keeps the all-zero test cheap), not the last layer's bias: it shifts
    every output alike, so a loss that compares outputs with each other (a WGAN critic's mean difference, a distance
    between two embeddings) gives it no gradient at all, and a gradient that is always zero looks reset by every
    pass: a ``zero_grad`` left out would never show."""
    idx = comp.index
    pool_ids = {id(p) for p in watched(comp)}
    cands = [i for i, p in enumerate(idx.params) if id(p) in pool_ids]
    if not cands:
        return None
    first, last = idx.layers[idx.index_of[cands[0]]], idx.layers[idx.index_of[cands[-1]]]
    pool = [i for i in cands if idx.layers[idx.index_of[i]] in (first, last)]
    live = [i for i in pool if not (idx.layers[idx.index_of[i]] == last and idx.names[i].rpartition(".")[2] == "bias")]
    return min((idx.params[i] for i in live or pool), key=lambda p: p.numel())

"""NaN replay probe: keeps what a replay needs and, when ``nonfinite_loss`` / ``nonfinite_grad`` /
``nonfinite_input`` fires, replays the bad step's batch once (see :mod:`trackdiag.forensics.replay`) and
writes the culprit into the alert: ``where="body.2 (input finite)"`` and the message
(:mod:`trackdiag.probes._replay_report`).

What it keeps:
  * *references* (``detach()``-ed views, no copies) to the arguments of every training-mode forward
    of each root model with grad enabled (the first ``max_calls``, 8, per step), with the autocast
    state, for the last ``ring`` steps (default: the session's ``every`` + 1). During the step a call
    costs one list append (the arguments as passed); they are detached when the step ends. They are seen through the root's call slot
    (:mod:`trackdiag.capture.root_call`: an attribute ``torch.save``, pickle and ``deepcopy`` drop, so a saved
    model stays clean, and the model's other modules keep PyTorch's fast call path; a global forward
    hook when ``module.compile()`` took the slot). On a model that was already compiled before the session, or when nothing was
    captured, the batch given to ``step(batch=...)`` is replayed as ``model(inputs)``. Memory cost:
    those input batches stay alive ``ring`` steps longer (``ring`` x batch bytes on their device).
  * (``mode=log``) a copy of the weights from a logging step whose record was entirely finite, taken
    at most every ``snapshot_every`` (20) steps (:mod:`trackdiag.forensics.snapshot`; ``snapshot_mb`` caps it,
    default 1024 MB; 0 turns it off): when the optimizer has already written NaN into the weights by
    the time the fault is noticed (the usual case at the default cadence), the bad step's batch is
    replayed on those weights instead (at most ``every`` + ``snapshot_every`` steps older). Cost: one
    copy of the parameters per ``snapshot_every`` steps, 1x parameter memory.

With the user's loss computation (``Diagnostics(..., loss_fn=lambda batch: ...)``) and the step's
batch, the replay runs that computation on the batch instead of the captured calls: a model that
returns its own loss, takes several inputs or is driven step by step by the loop is replayed whole.
When a replay cannot reproduce the fault and the flight recorder's per-module flags
(``probes.flight.modules``) saw it in the real step, those name the module; else the alert says
plainly that the culprit could not be found.

Modes:
  ``log`` (default, no sync): replay at the logging step that notices the fault, on the current
  weights if they are finite, else on the snapshot (at most ``every`` steps older than the fault).
  ``step``: at every optimizer step, check the gradients (ONE host sync per step: per backward pass, the
  components it reached read together) and replay right there, before the optimizer applies the bad update:
  exact in every case.
Replays run eagerly (``torch.compile`` stance ``force_eager``), restore buffers, RNG and the
modules' plain attributes, and are not seen by the gradient tap.
Emits no metric keys. Options: ``loss_fn`` (callable or dotted path, ``fn(outputs, batch) -> loss``:
the older per-output form; the session's ``loss_fn(batch)`` takes precedence; default: the model's
own loss, else cross-entropy/MSE guessed from the batch), ``backward``, ``max_replays`` (1), ``snapshot_mb``.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import time
from typing import Any, Iterator

import torch
from torch import nn

from trackdiag.alerts.incidents import nonfinite
from trackdiag.capture.context import Component, ProbeContext, StepInputs
from trackdiag.capture.forward_watch import FORWARD, may_watch
from trackdiag.capture.grad_records import GradView
from trackdiag.core.alert import Alert
from trackdiag.core.errors import ConfigError, brief
from trackdiag.core.record import Record
from trackdiag.core.registry import resolve
from trackdiag.forensics.replay import Call, Finding, replay
from trackdiag.forensics.snapshot import ParamSnapshot
from trackdiag.probes._replay_report import FLAGS_KEY, TRIGGERS, Joint, detached, enrich, held  # noqa: F401 (re-exported)
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never
from trackdiag.util.tensors import inputs_of

log = logging.getLogger("trackdiag")
MODES = ("log", "step")


class NanReplayProbe(Probe):
    """See module docstring."""

    name = "nan_replay"

    def __init__(self, *, enabled: bool = True, every: int | None = None, mode: str = "log", loss_fn: Any = None,
                 ring: int | None = None, max_replays: int = 1, max_calls: int = 8, backward: bool = True,
                 snapshot_mb: float = 1024.0, snapshot_every: int = 20) -> None:
        super().__init__(enabled=enabled, every=every)
        # mode=step replays before the bad update: no earlier weights needed
        self._snapshot_limit = int(max(snapshot_mb, 0.0) * 2**20)
        self.snapshot_bytes = self._snapshot_limit if mode == "log" else 0
        self.snapshot_every = max(1, snapshot_every)
        self._snapped = -(10**9)
        self._snapshots: dict[str, ParamSnapshot] = {}
        self._stops: list[Any] = []
        self._watch_parts: dict[str, str] = {}  # component -> device type, until its outermost calls are watched
        self._depths: dict[str, list[int]] = {}
        if mode not in MODES:
            raise ConfigError([f"diag.probes.nan_replay.mode: {mode!r} is not one of {', '.join(MODES)}"])
        self.mode, self.ring, self.max_replays, self.max_calls, self.backward = mode, ring, max_replays, max_calls, backward
        self.loss_fn = resolve(loss_fn) if isinstance(loss_fn, str) else loss_fn
        self._size = ring or 2
        self._ring: collections.OrderedDict[int, dict[str, Any]] = collections.OrderedDict()
        self._pending: dict[str, list[list[Any]]] = {}  # the running step's calls, as passed (see _capturer)
        self.findings: dict[int, tuple[str, Finding]] = {}
        self.replays = 0
        self.reads = 0  # host reads made by ``mode=step``
        self._cleared: list[Any] = []  # taps of other components judged finite with an earlier one this step
        self.told: dict[tuple[str, int], tuple[str, int, bool]] = {}  # finding -> (kind, step) told, data at fault
        self._busy = False
        self._ctx: ProbeContext | None = None
        self.shed_at: int | None = None  # the step the cost budget stopped the capture at (:meth:`stop_capture`)

    def bind(self, default_every: int) -> None:
        self._size = self.ring or (self.every or default_every) + 1
        self.schedule = Never()  # collects nothing: never the reason for a logging step

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx
        watch = may_watch(ctx.compiled)
        for comp in ctx.components:
            if comp.model is None:
                continue
            if self.snapshot_bytes:
                self._snapshots[comp.name] = ParamSnapshot(comp.model, self.snapshot_bytes)
            if watch:
                dev = comp.index.params[0].device.type if comp.index.params else "cpu"
                self._stops.append(FORWARD.watch(comp.outer if comp.outer is not None else comp.model,
                                                 post=self._capturer(comp.name, dev), root=True))
                self._watch_parts[comp.name] = dev

    def to_log_mode(self, ctx: ProbeContext) -> None:
        """The cost budget's first shed (:mod:`trackdiag.session.budget_policy`): ``mode=step`` becomes ``mode=log`` (no host read
        per step; the replay runs at the logging step from a weight snapshot, taken from the next finite one)."""
        if self.mode != "step":
            return
        self.mode, self.snapshot_bytes = "log", self._snapshot_limit
        for comp in ctx.components:
            if comp.model is not None and self.snapshot_bytes and comp.name not in self._snapshots:
                self._snapshots[comp.name] = ParamSnapshot(comp.model, self.snapshot_bytes)

    def stop_capture(self, step: int) -> None:
        """The cost budget's last shed (:mod:`trackdiag.session.budget_policy`): the training forwards' arguments are no longer
        kept (no call slot, nothing per forward call). A step given ``batch=...`` is still replayed (the user's
        loss, else ``model(inputs)``); a step without one says why nothing of it was held."""
        self._unwatch()
        self.shed_at = step

    @property
    def capturing(self) -> bool:
        """Whether training forwards are being kept (a call slot or submodule watchers installed)."""
        return bool(self._stops)

    def _unwatch(self) -> None:
        """No forward call is watched or pending from here on."""
        for stop in self._stops:
            stop()
        self._stops.clear()
        self._watch_parts.clear()
        self._depths.clear()
        self._pending.clear()

    def _watch_outermost(self, comp: Component) -> None:
        """The model's own forward was not called in a step (``model.log_prob(x)``, ``model.loss(x)``:
        the loop calls a method that runs the submodules): from now on keep the outermost submodule
        calls of each step instead (those made while no other submodule of the model is running), and
        the replay runs them in order. One pre- and one post-hook call per module call of this model
        (~2 us each on CPU), paid only by models whose forward is never called."""
        dev = self._watch_parts.pop(comp.name, None)
        if dev is None or comp.model is None:
            return
        depth = self._depths[comp.name] = [0]  # reset at each step (a forward that raised never left)
        capture = self._capturer(comp.name, dev, submodule=True)

        def enter(module: nn.Module, args: tuple[Any, ...]) -> None:
            depth[0] += 1

        def leave(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            depth[0] = max(depth[0] - 1, 0)
            if depth[0] == 0:
                capture(module, args, kwargs, output)

        for name, module in comp.model.named_modules():
            if name:
                self._stops.append(FORWARD.watch(module, pre=enter, post=leave))

    def detach(self) -> None:
        self._unwatch()
        self._ring.clear()
        self._snapshots.clear()

    def after_record(self, ctx: ProbeContext, record: Record) -> None:
        """A logging step whose record is entirely finite, at least ``snapshot_every`` steps after the
        last copy: keep these weights for a later replay."""
        if self._snapshots and ctx.step - self._snapped >= self.snapshot_every and not nonfinite(record):
            self._snapped = ctx.step
            for snap in self._snapshots.values():
                snap.take(ctx.step + 1)  # the weights the next step's forward will use

    def _capturer(self, comp: str, device_type: str, submodule: bool = False) -> Any:
        """The forward watcher of a root model: keeps each training forward's arguments as passed, up
        to ``max_calls`` per step (one list append; detached when the step ends, :meth:`_flush`).
        ``submodule``: the watcher of a submodule's outermost call (:meth:`_watch_outermost`), replayed on it."""
        pending, max_calls = self._pending, self.max_calls
        grad_enabled, autocast, clock = torch.is_grad_enabled, torch.is_autocast_enabled, time.perf_counter

        def capture(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if self._busy or not module.training or not grad_enabled():
                return
            t0 = clock()
            calls = pending.get(comp)
            if calls is None:
                calls = pending[comp] = []
            elif len(calls) >= max_calls:  # a loop calling the model many times per step: the first ones
                return
            dev = device_type if device_type != "meta" else _device_of(module)
            amp = (dev, torch.get_autocast_dtype(dev)) if autocast(dev) else None
            calls.append([args, kwargs, amp, module] if submodule else [args, kwargs, amp])  # tuples once detached
            if self._ctx is not None:  # inside the user's forward: the session's clock misses it
                self._ctx.hook_seconds += clock() - t0
        return capture

    def _flush(self, step: int) -> dict[str, Any] | None:
        """The running step's calls into its ring entry (made if new, the oldest dropped past the ring's
        size), as a replay keeps them: tensors ``detach()``-ed (no copy; the graph goes). Returns the entry."""
        entry = self._ring.get(step)
        if not self._pending:
            return entry
        if entry is None:
            entry = self._ring[step] = {"calls": {}, "batch": None}
            while len(self._ring) > self._size:
                self._ring.popitem(last=False)
        for comp, calls in self._pending.items():
            kept = entry["calls"].setdefault(comp, [])
            for c in calls:
                c[0] = held(c[0])
                if c[1]:
                    c[1] = detached(c[1])
                kept.append(tuple(c))
        self._pending.clear()
        return entry

    def _entry(self, step: int) -> dict[str, Any] | None:
        """The ring entry of ``step``, the running step's calls included."""
        return self._flush(step) if self._ctx is not None and step == self._ctx.step else self._ring.get(step)

    def calls_of(self, step: int, component: str | None = None) -> list[Call]:
        """The forward calls captured at ``step`` (for ``component``, default the first model's)."""
        entry = self._entry(step) or {"calls": {}}
        calls = entry["calls"]
        if component is not None:
            return list(calls.get(component, []))
        return list(next(iter(calls.values()), []))

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        entry = self._flush(ctx.step)
        for depth in self._depths.values():
            depth[0] = 0
        if self._watch_parts and torch.is_grad_enabled():  # decided once per model, at its first step
            called = (entry or {}).get("calls") or {}
            for comp in ctx.components:
                if comp.name in called:  # its own forward is used: nothing more to decide
                    self._watch_parts.pop(comp.name, None)
                elif comp.name in self._watch_parts:  # not called this step: watch its parts instead
                    self._watch_outermost(comp)
        if entry is None and inputs.batch is not None:  # nothing captured (compiled before the session)
            entry = self._ring[ctx.step] = {"calls": {}, "batch": None, "guessed": True}
            model_input = inputs_of(inputs.batch)
            for comp in ctx.components:
                if comp.model is not None:
                    entry["calls"][comp.name] = [((detached(model_input),), {}, None)]
            while len(self._ring) > self._size:
                self._ring.popitem(last=False)
        if entry is not None:
            entry["batch"] = inputs.batch

    def on_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        """``mode=step``: one host sync on the gradients' finiteness; replay before the update."""
        if self.mode != "step" or self.replays >= self.max_replays or comp.model is None or not comp.index.params:
            return
        finite = self._finite(ctx, view)
        flags = ctx.extra.get(FLAGS_KEY)
        if flags is not None:  # the flight recorder needs no flags of a step judged healthy
            flags.judged(finite)
        if finite:
            return
        self.replays += 1
        found = self.run(ctx, comp, ctx.step, None, exact=True)
        if found[1].phase == "none":  # not made here: a model the same backward pass reached, not stepped yet
            for other in (c for c, _ in (ctx.waiting() if ctx.waiting is not None else ()) if c is not comp):
                if other.model is not None and other.index.params:
                    got = self.run(ctx, other, ctx.step, None, exact=True)
                    if got[1].phase != "none":
                        found = got
                        break
        self.findings[ctx.step] = found

    def _finite(self, ctx: ProbeContext, view: GradView) -> bool:
        """Whether ``view``'s gradients are all finite: the host read of ``mode=step``, one per backward pass. The
        passes of other components that wait for their own optimizer (one backward through an encoder and a decoder
        with an optimizer each) are read with it, and their check reads nothing when all were finite."""
        tap = view.tap
        if any(t is tap for t in self._cleared):
            return True
        total = view.total
        others = [t for _, t in (ctx.waiting() if ctx.waiting is not None else ())  # model parallel: one read per device
                  if t is not tap and t.total.device == total.device]
        self.reads += 1
        if others and bool(torch.isfinite(torch.stack([total, *(t.total for t in others)])).all()):
            self._cleared = others
            return True
        self._cleared = []
        self.reads += bool(others)  # one of them is not finite: this pass on its own (a second read, at a fault only)
        return math.isfinite(float(total))

    def on_more_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        """``mode=step``: a later optimizer's own pass is judged before its update too."""
        self.on_grads(ctx, comp, view)

    @contextlib.contextmanager
    def capture_paused(self) -> Iterator[None]:
        """A replay of trackdiag's own is running: its forward calls are not captured as training ones."""
        try:  # set inside the try: a KeyboardInterrupt right after it must not leave capture off
            self._busy = True
            yield
        finally:
            self._busy = False

    def run(self, ctx: ProbeContext, comp: Component, step: int, batch: Any, exact: bool = False,
            backward: bool | None = None) -> tuple[str, Finding]:
        """Replay ``step`` for ``comp`` (all components together when the user's loss is replayed);
        ``exact``: the current weights are the ones step ``step`` ran on. Returns (component, finding)."""
        entry = self._entry(step) or {"calls": {}}
        batch_loss = ctx.loss_fn if batch is not None else None
        model: nn.Module | None = comp.model
        name, snapshot = comp.name, self._snapshots.get(comp.name)
        models = {c.name: c.model for c in ctx.components if c.model is not None}
        if batch_loss is not None and len(models) > 1 and all(n and "." not in n for n in models):
            model, name = nn.ModuleDict(models), ""  # the user's loss runs every model: watch them all
            snapshot = Joint([self._snapshots[n] for n in models if n in self._snapshots]) if self._snapshots else None
        weights = f"the weights of step {step}" if exact else f"the current weights (step {ctx.step})"
        try:
            with self.capture_paused():
                found = replay(model, entry["calls"].get(comp.name, []), step=step, batch=batch,  # type: ignore[arg-type]
                               loss_fn=self.loss_fn, backward=self.backward if backward is None else backward,
                               snapshot=snapshot, batch_loss=batch_loss, weights=weights, exact=exact)
        except Exception as exc:  # noqa: BLE001 - a replay never kills training
            found = Finding(step, "error", detail=f"the replay could not run the model ({brief(exc)})")
        log.info("trackdiag: NaN replay of step %d: %s", step, found.detail or found.phase)
        return name, found

    def running(self, ctx: ProbeContext) -> tuple[str, Finding] | None:
        """The flight recorder at a crash: replay the step in progress (its captured forward calls, on
        the current weights: the optimizer has not stepped since), forward only. None without calls."""
        entry = self._flush(ctx.step)
        if entry is None or not entry["calls"]:
            return None
        got: tuple[str, Finding] | None = None
        for comp in ctx.components:
            if comp.model is not None and comp.name in entry["calls"]:
                got = self.run(ctx, comp, ctx.step, None, exact=True, backward=False)
                if got[1].located:
                    break
        return got

    def finding(self, ctx: ProbeContext, step: int) -> tuple[str, Finding] | None:
        """The replay result for ``step``: its own, else an earlier one of the same incident (within
        the ring), else a new replay while ``max_replays`` allows, else the latest one (so later alerts
        of a run that stays non-finite keep the same ``where`` and the cooldown still groups them)."""
        if step in self.findings:
            return self.findings[step]
        earlier = [s for s in self.findings if s <= step]
        if earlier and (max(earlier) >= step - self._size or self.replays >= self.max_replays):
            return self.findings[max(earlier)]
        if self.replays >= self.max_replays:
            return None
        entry = self._entry(step)
        if entry is None or not entry["calls"]:
            why = (f"the cost budget stopped keeping the training forwards at step {self.shed_at} and the step gave no "
                   "batch= (diag.budget=null keeps them)" if self.shed_at is not None and step >= self.shed_at
                   else f"ring of {self._size} steps")
            return "", Finding(step, "unavailable", detail=f"no training forward of step {step} is held ({why}).")
        self.replays += 1
        got: tuple[str, Finding] | None = None
        for comp in ctx.components:
            if comp.model is not None and comp.name in entry["calls"]:
                got = self.run(ctx, comp, step, entry["batch"])  # log mode: the optimizer has stepped since
                if got[1].phase != "none":
                    break
        if got is not None:
            self.findings[step] = got
        return got

    def guessed(self, step: int) -> bool:
        """Whether step ``step``'s replay calls were guessed from the batch (nothing was captured)."""
        return bool((self._ring.get(step) or {}).get("guessed"))

    def enrich(self, ctx: ProbeContext, alerts: list[tuple[Any, Alert]]) -> list[tuple[Any, Alert]]:
        """``alerts`` with the culprit in ``where`` (see :func:`trackdiag.probes._replay_report.enrich`)."""
        return enrich(self, ctx, alerts)


def _device_of(module: nn.Module) -> str:
    """The device type of a model built on the meta device and materialised after the session began."""
    dev = next((p.device.type for p in module.parameters()), "cpu")
    return "cpu" if dev == "meta" else dev

"""Zero-grad probe: were the gradients reset when they should be, and only then?

Made from what the gradient tap's sentinel saw (see :mod:`trackdiag.capture.gradtap`): for each backward
pass, whether one chosen parameter's gradient had been reset (``None``, or all zero) before the pass
accumulated into it, and that parameter's version counter (it changes when the optimizer updates
the parameters in place). Two verdicts per step, for every step and every loop style:

* **not zeroed** (``grads_not_zeroed``): backward passes ran since the previous step and none of
  them started from a reset gradient, so the step used the sum of this step's and earlier steps'
  gradients. No false positive for accumulation over micro-batches (the first one sees the reset),
  GAN loops where another loss backpropagates into this model before it is zeroed, or closure
  optimizers (the closure's ``zero_grad`` is seen inside ``step()``). With ``accumulation_steps`` =
  k > 1 gradients may be carried over k steps: only k steps in a row without a reset count.
* **reset inside the accumulation window** (``accumulation_reset``): two or more of the step's
  backward passes started from a reset gradient while the parameters did not change between them:
  every pass but the last was thrown away (``model.zero_grad()`` inside accelerate's
  ``accumulate``, instead of the prepared optimizer's). Passes separated by a parameter update
  (LBFGS line search, SAM's two passes) are not counted together. A step whose model was fed an
  input that asks for its own gradient (adversarial training, saliency: :mod:`trackdiag.capture.input_grads`)
  is marked ``input_grad`` in the table: its extra pass was for that input, and the rule says so
  as an ``info`` finding. Seen through the model's call slot (the first call of each step; the
  graph walk only on a step with several passes). A loop that ran ``WATCH_STEPS`` (20) steps with
  one backward pass each stops being watched (nothing per call from then on); should several passes
  per step begin later, watching resumes, and the first such step (its inputs unseen) is not judged
  for ``accumulation_reset``: the next one is.

Emits per component, at the logging step: ``diag/[<c>/]grad/not_zeroed`` and
``diag/[<c>/]grad/accum_reset`` (1.0 when some step of the window failed, else 0.0), and the tables
``grad/zero_check`` / ``grad/accum_check`` = ``{"step": first failing step, "backwards": its passes, "count":
failing steps in the window, "near": 1.0 when two of them are at most ``NEAR`` (2) steps apart, "last": the last
one}`` (``accum_check`` also ``"input_grad"``: 1.0 when that step's model input asked for its gradient).
Cost per step: nothing when the loop zeroes with ``set_to_none`` (the usual way); otherwise one
``|`` per backward pass of small device booleans. No host read off logging steps.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import Component, ProbeContext
from trackdiag.capture.forward_watch import FORWARD, may_watch
from trackdiag.capture.grad_records import GradView, Pass
from trackdiag.capture.input_grads import grad_inputs, wanted
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.norms import stack_scalars

Flag = bool | torch.Tensor
#: a loop with one backward pass per step for this many steps stops having its model inputs watched
WATCH_STEPS = 20
#: two failing steps at most this far apart are the loop's habit, not two one-offs (see rules/zerograd.py)
NEAR = 2


def _any(flags: list[Flag]) -> Flag:
    """OR of host and device booleans: host True wins at once, else one device OR chain."""
    if any(f is True for f in flags):
        return True
    dev = [f for f in flags if isinstance(f, torch.Tensor)]
    if not dev:
        return False
    out = dev[0]
    for f in dev[1:]:
        out = out | f
    return out


def _count(flags: list[Flag]) -> int | torch.Tensor:
    host = sum(1 for f in flags if f is True)
    dev = [f for f in flags if isinstance(f, torch.Tensor)]
    return host if not dev else host + torch.stack(dev).sum()


def wiped(passes: list[Pass]) -> Flag:
    """Two or more resets among passes with no parameter update between them (the same version counter
    and, where both passes kept it, the same sum of the sentinel's values: a ``p.data`` update changes no
    version counter)."""
    same = [_unchanged(a, b) for a, b in zip(passes, passes[1:])]
    if all(type(s) is bool for s in same):
        runs: list[list[Pass]] = []
        for i, p in enumerate(passes):
            if i and same[i - 1]:
                runs[-1].append(p)
            else:
                runs.append([p])
        out: list[Flag] = []
        for run in runs:
            if len(run) >= 2:
                n = _count([_definite(p) for p in run])
                out.append(n >= 2)
        return _any(out)
    # the values decide on the device: the running count of resets of the current run (device ops, no read)
    ref = next(s for s in same if isinstance(s, torch.Tensor))
    count: torch.Tensor | None = None
    hits: list[torch.Tensor] = []
    for i, p in enumerate(passes):
        d = _definite(p)
        d = d.float() if isinstance(d, torch.Tensor) else ref.new_full((), 1.0 if d else 0.0, dtype=torch.float32)
        if count is None:
            count = d
            continue
        s = same[i - 1]
        count = (count + d) if s is True else d if s is False else torch.where(s, count + d, d)
        hits.append(count >= 2)
    return torch.stack(hits).any()


def _unchanged(a: Pass, b: Pass) -> Flag:
    """Whether the parameters were the same for passes ``a`` and ``b`` (a device bool when both kept their values)."""
    if a.param_version != b.param_version:
        return False
    if a.value is None or b.value is None:
        return True
    return a.value == b.value


def _definite(p: Pass) -> Flag:
    """A reset only if the pass before had left a non-zero gradient (a dead sentinel's zeros are not one)."""
    prev = p.prev_nonzero
    if prev is True or p.reset is False:
        return p.reset
    if prev is False:
        return False
    if isinstance(prev, torch.Tensor) and prev.dtype is not torch.bool:
        prev = prev != 0  # the sentinel's norm after that pass (device op, accumulation loops only)
    return p.reset & prev if isinstance(p.reset, torch.Tensor) else prev


class ZeroGradProbe(Probe):
    """See module docstring. Args: ``accumulation_steps`` optimizer steps the gradients may legitimately span."""

    name = "zerograd"
    always_collect = True

    def __init__(self, *, enabled: bool = True, every: int | None = None, accumulation_steps: int = 1) -> None:
        super().__init__(enabled=enabled, every=every)
        if accumulation_steps < 1:
            raise ConfigError([f"diag.probes.zerograd.accumulation_steps: must be >= 1, got {accumulation_steps!r}"])
        self.accumulation_steps = accumulation_steps
        self._windows: dict[str, deque[Flag]] = {}
        self._verdicts: dict[str, list[tuple[int, int, Flag, Flag]]] = {}
        self._asked: set[tuple[str, int]] = set()  # (component, step) of multi-pass steps fed an input-gradient input
        self._meta: dict[str, list[tuple[int, int, list[float]]]] = {}
        self._fed: dict[str, tuple[int, list[torch.Tensor]]] = {}  # component -> (step, its first call's grad-requiring inputs)
        self._stops: list[Any] = []
        self._ctx: ProbeContext | None = None
        self._multi = False  # a step with several backward passes was seen
        self._resting = False  # watching stopped after WATCH_STEPS steps of one pass each
        self._blind = -1  # the step several passes resumed at, unwatched: not judged for accumulation_reset

    def attach(self, ctx: ProbeContext) -> None:
        self._ctx = ctx
        self._watch()

    def _watch(self) -> None:
        """Watch each model's first call of a step (its call slot), unless compiled models would pay a recompile."""
        ctx = self._ctx
        if ctx is None or self._stops or not may_watch(ctx.compiled):
            return
        for comp in ctx.components:
            if comp.model is not None:
                root = comp.outer if comp.outer is not None else comp.model
                self._stops.append(FORWARD.watch(root, post=partial(self._inputs, comp.name), root=True))

    def detach(self) -> None:
        for stop in self._stops:
            stop()
        self._stops.clear()

    def _inputs(self, name: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """Forward watcher: keep the first call's inputs that require grad (references; judged only on a
        step with several backward passes)."""
        step = self._ctx.step if self._ctx is not None else -1
        fed = self._fed.get(name)
        if (fed is None or fed[0] != step) and torch.is_grad_enabled():  # an evaluation between steps is no first call
            self._fed[name] = (step, grad_inputs(args, kwargs))

    def on_grads(self, ctx: ProbeContext, comp: Component, view: GradView) -> None:
        passes = view.passes
        fed = self._fed.pop(comp.name, None)
        if not passes:  # no backward reached the component: no verdict
            return
        if len(passes) > 1 and not self._multi:  # several passes per step after all: watch the inputs again
            self._multi = True
            if self._resting:  # this step's inputs nobody saw: judged from the next step on
                self._resting, self._blind = False, ctx.step
            self._watch()
        elif not self._multi and ctx.step >= WATCH_STEPS and self._stops:  # one pass per step: stop watching
            self.detach()
            self._resting = True
        if len(passes) == 1 and passes[0].reset is True and self.accumulation_steps == 1:
            # the usual step: one backward pass into gradients that were None (host facts: no kernel)
            self._verdicts.setdefault(comp.name, []).append((ctx.step, 1, False, False))
            return
        reset = _any([p.reset for p in passes])
        window = self._windows.setdefault(comp.name, deque(maxlen=self.accumulation_steps))
        window.append(reset)
        if len(window) < self.accumulation_steps:
            stale: Flag = False
        else:
            any_reset = _any(list(window))
            stale = (not any_reset) if isinstance(any_reset, bool) else ~any_reset
        self._verdicts.setdefault(comp.name, []).append((ctx.step, len(passes), stale, False if self._blind == ctx.step else wiped(passes)))
        if fed is not None and fed[0] == ctx.step and wanted(fed[1]):
            self._asked.add((comp.name, ctx.step))

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        """Device flags go in one stacked tensor (no tensor is made from host data); host flags
        stay on the host with the steps."""
        out: dict[str, Any] = {}
        self._meta = {}
        for name, verdicts in self._verdicts.items():
            dev: list[torch.Tensor] = []
            rows = []
            for step, backwards, *flags in verdicts:
                slots = []
                for f in flags:
                    if isinstance(f, torch.Tensor):
                        slots.append(len(dev))
                        dev.append(f)
                    else:
                        slots.append(-1.0 - float(f))  # host value v stored as -1 - v
                rows.append((step, backwards, slots))
            if dev:
                out[name] = stack_scalars(dev)
            out[f"{name}|rows"] = float(len(rows))  # host number: publish runs even without device flags
            self._meta[name] = rows
        self._verdicts = {}
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            rows = self._meta.get(comp.name)
            if not rows:
                continue
            dev = values.get(comp.name)
            flags = [[float(dev[s]) if s >= 0 else -1.0 - s for s in slots] for _, _, slots in rows]
            for col, key, table in ((0, "not_zeroed", "zero_check"), (1, "accum_reset", "accum_check")):
                bad = [i for i, f in enumerate(flags) if f[col] > 0.5]
                record.scalars[comp.key(f"grad/{key}")] = 1.0 if bad else 0.0
                step, backwards, _ = rows[bad[0]] if bad else rows[-1]
                steps = [rows[i][0] for i in bad]
                near = any(b - a <= NEAR for a, b in zip(steps, steps[1:]))
                record.tables[comp.key(f"grad/{table}")] = {"step": float(step), "backwards": float(backwards),
                                                            "count": float(len(bad)), "near": 1.0 if near else 0.0,
                                                            "last": float(steps[-1] if steps else step)}
                if col == 1 and (comp.name, step) in self._asked:
                    record.tables[comp.key(f"grad/{table}")]["input_grad"] = 1.0
        self._asked.clear()

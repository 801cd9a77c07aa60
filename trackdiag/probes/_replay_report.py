"""How the NaN replay's result reaches the alerts: the culprit in ``where``, the account in the
message, the remedies that fit in the hint; and what to say when the replay did not find one.

When the replay names no module (the fault did not reproduce, the replay could not call the model,
nothing of the step was held, or the optimizer had already broken the weights) and the flight
recorder's per-module flags (:mod:`trackdiag.capture.output_flags`) saw a non-finite output in the real step,
that module is the culprit (``where="body.2 (LogLayer, seen in the step's forward)"``). Otherwise
``where`` stays the rule's own (``diag/loss``) and the message says plainly that the culprit could
not be found and why. Host work plus, only when an alert asks, one host read of the step's flags.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

import torch

from trackdiag.alerts.incidents import order
from trackdiag.capture.context import ProbeContext
from trackdiag.capture.user_loss import ENABLE, skipped
from trackdiag.core.alert import Alert
from trackdiag.forensics.replay import NOT_FOUND, Finding
from trackdiag.capture.components import stepped_inputs
from trackdiag.forensics.replay_hints import replay_hint
from trackdiag.forensics.snapshot import ParamSnapshot
from trackdiag.util.modnames import module_type, needs_type

log = logging.getLogger("trackdiag")
TRIGGERS = ("nonfinite_loss", "nonfinite_grad", "nonfinite_input")
FLAGS_KEY = "output_flags"  # ctx.extra key of the flight recorder's OutputFlags


def detached(obj: Any, depth: int = 0) -> Any:
    """``obj`` with every tensor replaced by a ``detach()``-ed view (drops the graph, copies nothing)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if depth < 4 and isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(detached(v, depth + 1) for v in obj)
    if depth < 4 and isinstance(obj, dict):
        return {k: detached(v, depth + 1) for k, v in obj.items()}
    return obj


def held(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A forward's positional arguments as kept for a replay: :func:`detached`, with the common case
    (a tuple of tensors) in one pass, and tensors outside any graph kept as they are (a ``detach``
    per tensor, ~0.4 us, only where it drops a graph)."""
    if type(args) is not tuple:
        return detached(args)
    out = []
    for a in args:  # a loop, not a generator: this runs at every captured forward call
        out.append((a.detach() if a.requires_grad else a) if type(a) is torch.Tensor else detached(a, 1))
    return tuple(out)


class Joint:
    """Several components' weight snapshots applied together (the user's loss runs every model)."""

    def __init__(self, snaps: list[ParamSnapshot]) -> None:
        self.snaps = snaps
        steps = [s.step for s in snaps]
        self.step = min(steps) if steps and None not in steps else None  # type: ignore[type-var]
        self.refused = next((s.refused for s in snaps if s.refused), "")

    @contextlib.contextmanager
    def applied(self) -> Iterator[int]:
        with contextlib.ExitStack() as stack:
            yield min(stack.enter_context(s.applied()) for s in self.snaps)


def observed(ctx: ProbeContext, found: Finding, comp: str) -> tuple[str, Finding]:
    """``(component, finding)``: the flight recorder's flags of the real step when they name a module
    the replay could not; else ``found`` with a plain account of why no culprit was found."""
    flags = ctx.extra.get(FLAGS_KEY)
    seen = flags.first_bad(found.step) if flags is not None else None
    if seen is not None:
        (where_comp, module), inp, calls, bad = seen
        label = f"{where_comp}.{module}" if where_comp and len(ctx.components) > 1 else module
        why = {"none": "it did not reproduce", "error": found.detail.rstrip("."), "unavailable": found.detail.rstrip(".")}.get(
            found.phase, "the weights were already non-finite")
        return where_comp, Finding(found.step, "observed", module, inp, (
            f"the hooks saw the first non-finite output of step {found.step}'s own forward come out of {label}"
            f"{input_note(inp)} ({bad} of the {calls} module outputs recorded in that step held NaN/Inf); "
            f"the replay did not locate it ({why})."))
    if found.phase == "error":
        if ctx.loss_fn is None:
            skipped(ctx, "nan_replay", found.detail)
        return comp, dataclasses.replace(found, detail=(
            f"{NOT_FOUND}: {found.detail}. To have the replay run your own loss computation, {ENABLE}; with "
            f"diag.probes.flight.modules=true the hooks name the module in the real step"))
    if found.phase == "unavailable":
        return comp, dataclasses.replace(found, detail=f"{NOT_FOUND}: {found.detail}")
    return comp, found


def input_note(inp: bool | None) -> str:
    """What the flags say about the input of the first non-finite module."""
    if inp is False:
        return (", whose input already held NaN/Inf: the NaN/Inf was made before it, in code the hooks cannot see "
                "(functional ops between modules, layers called as .forward()); the culprit could not be narrowed further")
    return " from a finite input" if inp else ""


def enrich(probe: Any, ctx: ProbeContext, alerts: list[tuple[Any, Alert]]) -> list[tuple[Any, Alert]]:
    """``alerts`` with the replay's culprit in ``where``, a hint that follows what the replay found,
    and the replay's account in the message: in full in the first alert of an incident (the input,
    then the loss, grad, param alert: the order they are emitted in), as a reference in the others."""
    out = []
    data = any(a.kind == "nonfinite_input" and a.evidence for _, a in alerts)
    stepped = any(stepped_inputs(c) for c in ctx.components)  # the batch is what the optimizer steps
    for rule, alert in sorted(alerts, key=lambda ra: order(ra[1])):
        # NaN/Inf in the batch that the loop handles (masked labels: no evidence it reached anything) replays nothing
        handled = alert.kind == "nonfinite_input" and not alert.evidence
        got = probe.finding(ctx, alert.step) if alert.kind in TRIGGERS and not handled else None
        if got is not None:
            comp, found = got
            if not found.located or (found.phase == "params" and found.input_finite is not False):
                comp, found = observed(ctx, found, comp)
                probe.findings[found.step] = (comp, found)
            model = next((c.model for c in ctx.components if c.name == comp), None)
            kind = module_type(model, found.module) if needs_type(found.module) else ""
            where = found.where(comp if len(ctx.components) > 1 else "", kind)
            told = probe.told.setdefault((comp, found.step), (alert.kind, alert.step, data))
            label = "NaN replay" if found.phase != "observed" else "Flight recorder"
            if told[:2] == (alert.kind, alert.step):
                account = f"{label} of step {found.step}: {found.detail}"
            else:
                account = f"{label} of step {found.step}: see the {told[0]} alert of step {told[1]}."
            alert = dataclasses.replace(
                alert, where=where if where and alert.kind != "nonfinite_input" else alert.where,
                message=f"{alert.message} {account}", hint=replay_hint(found, alert, where, data or told[2], stepped))
        out.append((rule, alert))
    return out

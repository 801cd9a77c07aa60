"""NaN root cause by replay: run one batch again, watching every module, and find where the first
non-finite value appears.

``replay(model, calls, ...)`` re-runs the captured forward calls of the bad step (same arguments,
same autocast state) or, when the user handed trackdiag their loss computation (``batch_loss``,
:mod:`trackdiag.capture.user_loss`) and the step's batch is held, that computation on the batch, with every
module's forward watched (:mod:`trackdiag.forensics.replay_recorder`; layers called as ``layer.forward(x)``
are seen too): the first module (execution order, so the innermost) whose output holds a NaN/Inf is
the culprit, and its input tells whether the value was already there. When every output is finite,
the loss (``batch_loss``, the model's own loss, ``loss_fn`` or the guessed cross-entropy/MSE) and a
backward pass (``torch.autograd.grad`` on the loss, or on the sum of the outputs) locate a non-finite
gradient: the innermost module whose output gradient is finite but whose input or parameter
gradients are not. Sparse gradients are read through their coalesced values.

Side effects: none that survive. Parameters' ``.grad`` are never touched (``autograd.grad``), the
optimizer is not used, buffers (BatchNorm statistics) are restored, the RNG is forked, every wrapper
is removed and every module's ``training`` flag is put back. Cost: one forward (+ one backward) of one
batch, and one host sync per module and tensor (only when a replay runs).

If the parameters already hold NaN/Inf (the optimizer applied the bad step's gradients before the
fault was noticed), a replay would blame the first layer: this is detected and reported as such.
A replay that stays finite does not name a culprit: it says which weights it ran on, and that the
fault did not reproduce there (a transient fault, state the replay cannot restore, other weights).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.capture.forward_watch import FORWARD
from trackdiag.capture.gradtap import TAP_QUEUE
from trackdiag.capture.isolation import eager, isolated, replaying
from trackdiag.capture.layers import ROOT
from trackdiag.capture.user_loss import loss_value, own_loss
from trackdiag.forensics.replay_recorder import Recorder, finite
from trackdiag.forensics.snapshot import ParamSnapshot
from trackdiag.util.sparse import finite_flag
from trackdiag.util.tensors import default_loss, float_tensors

#: args, kwargs, autocast[, the submodule called when the model's own forward was not]
Call = tuple[Any, ...]
NOT_FOUND = "The culprit could not be found"


@dataclass(frozen=True)
class Finding:
    """What a replay (or the flight recorder's flags) found. ``phase``: ``forward`` | ``backward`` |
    ``loss`` | ``params`` | ``observed`` (seen by the hooks in the real step, not replayed) | ``none``
    | ``unavailable`` | ``error``; ``module``: the culprit (``""`` when none)."""

    step: int
    phase: str
    module: str = ""
    input_finite: bool | None = None
    detail: str = ""

    @property
    def located(self) -> bool:
        """A module (or the loss function) was named."""
        return self.phase in ("forward", "backward", "loss", "observed") or (self.phase == "params" and bool(self.module))

    def where(self, component: str = "", kind: str = "") -> str:
        """The alert's ``where``: ``encoder.3 (input finite)``, ``head (backward)``, ``loss function``;
        with the module's type ``kind`` (given for bare indices): ``0 (Linear, input finite)``."""
        mod = f"{component}.{self.module}" if component and self.module else (self.module or component)
        typed = f"{kind}, " if kind else ""
        if self.phase == "forward":
            return f"{mod} ({typed}input {'finite' if self.input_finite else 'non-finite'})"
        if self.phase == "observed":
            state = {True: "input finite, ", False: "input non-finite, "}.get(self.input_finite, "")  # type: ignore[arg-type]
            return f"{mod} ({typed}{state}seen in the step's forward)"
        if self.phase == "backward":
            return f"{mod} ({typed}backward)"
        if self.phase == "loss":
            return "loss function"
        if self.phase == "params":  # the data is the cause when the bad step's input held NaN/Inf
            head = "input batch non-finite" if self.input_finite is False else mod
            return f"{head} ({typed if head == mod else ''}parameters already non-finite)"
        return ""


def nonfinite_state(model: nn.Module) -> list[str]:
    """Names of the parameters that hold a NaN/Inf and of the buffers that hold a NaN (or an Inf in
    a normalisation running statistic). An infinite buffer value is otherwise legitimate: attention
    masks (``nn.Transformer.generate_square_subsequent_mask``) are made of ``-inf``."""
    params = [(n, t, True) for n, t in model.named_parameters()]
    buffers = [(n, b, n.endswith(("running_mean", "running_var"))) for n, b in model.named_buffers() if b.is_floating_point()]
    named = [(n, t, strict) for n, t, strict in params + buffers if t.layout is torch.strided]
    if not named:
        return []
    flags = torch.stack([(torch.isfinite(t.detach()) if strict else ~torch.isnan(t.detach())).all().cpu()
                         for _, t, strict in named])  # replay/pre-flight path only
    return [n for (n, _, _), ok in zip(named, flags.tolist()) if not ok]


def nonfinite_params(model: nn.Module) -> list[str]:
    """Names of the parameters that hold a NaN/Inf (one host read per parameter: replay path only)."""
    named = [(n, p) for n, p in model.named_parameters() if p.layout is torch.strided]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(p.detach()).all().cpu() for _, p in named])
    return [n for (n, _), ok in zip(named, flags.tolist()) if not ok]


def layer_of(name: str) -> str:
    head = name.rpartition(".")[0]
    return head or ROOT


def replay(model: nn.Module, calls: list[Call], *, step: int, batch: Any = None,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, backward: bool = True,
           snapshot: ParamSnapshot | None = None, batch_loss: Callable[[Any], Any] | None = None,
           weights: str = "the current weights", exact: bool = False) -> Finding:
    """Replay step ``step`` on ``model`` (see module doc): ``batch_loss(batch)`` when both are given,
    else the captured ``calls``. ``weights`` says which weights the current ones are (for the account
    of a replay that stays finite); ``exact``: they are the ones step ``step`` began with (the optimizer has not
    stepped since). When the weights already hold NaN/Inf, the replay runs on ``snapshot`` (weights of an
    earlier, finite step) if there is one; an exact replay says they were written before the step."""
    runs = [_batch_run(batch_loss, batch)] if batch_loss is not None and batch is not None else [_call_run(model, c) for c in calls]
    if not runs:
        return Finding(step, "unavailable", detail=f"no forward call of step {step} was captured.")
    user_loss = batch_loss is not None and batch is not None
    with TAP_QUEUE.pause(), eager(), FORWARD.paused():
        bad_state = nonfinite_params(model)  # a training forward does not read BatchNorm's running stats
        if not bad_state:
            return _replay(model, runs, step, batch, loss_fn, backward, weights, user_loss)
        inputs_ok = finite([c[:2] for c in calls]) if calls else None
        why = snapshot.refused if snapshot is not None and snapshot.refused else "no earlier weights were kept"
        if snapshot is not None and snapshot.step is not None and snapshot.step <= step:
            with snapshot.applied() as at:
                if not nonfinite_params(model):
                    found = _replay(model, runs, step, batch, loss_fn, backward, f"the weights kept at step {at}", user_loss)
                    return dataclasses.replace(found, detail=(
                        f"{found.detail} (replayed on the weights of step {at}, {step - at} step(s) before the bad "
                        f"step: by the time it was noticed, the optimizer had already written NaN/Inf into the weights.)"))
            why = f"the weights kept at step {snapshot.step} are not finite either"
        data = "finite" if inputs_ok else "NON-finite" if inputs_ok is False else "not captured"
        if exact:  # the exact-step replay: the step began with these weights
            return Finding(step, "params", layer_of(bad_state[0]), inputs_ok, (
                f"{len(bad_state)} parameter/buffer tensor(s) held NaN/Inf when step {step} began (first: {bad_state[0]}): "
                f"written before its forward (by the loop itself, a checkpoint loaded, or an update whose gradients were "
                f"finite), not made by this step. The input batch was {data}."))
        return Finding(step, "params", layer_of(bad_state[0]), inputs_ok, (
            f"{len(bad_state)} parameter/buffer tensor(s) already hold NaN/Inf (first: {bad_state[0]}): the optimizer "
            f"applied the bad step's update before the fault was noticed, and {why}. The input batch was "
            f"{data}. To replay before the update, set diag.probes.nan_replay.mode=step "
            f"(Python: probes={{'nan_replay': {{'mode': 'step'}}}}: one host sync per step)."))


Run = tuple[Callable[[], Any], tuple[str, torch.dtype] | None, bool]  # forward, autocast, returns the loss


def _call_run(model: nn.Module, call: Call) -> Run:
    args, kwargs, autocast = call[:3]
    target = call[3] if len(call) > 3 else model  # a submodule's outermost call (the model's forward was not used)
    call = replaying(args, kwargs)  # a generator passed to the forward: the replay leaves it as it was
    return (lambda: call(target)), autocast, False


def _batch_run(batch_loss: Callable[[Any], Any], batch: Any) -> Run:
    return (lambda: batch_loss(batch)), None, True


def _replay(model: nn.Module, runs: list[Run], step: int, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
            backward: bool, weights: str, user_loss: bool) -> Finding:
    found = Finding(step, "none")
    with isolated(model), torch.enable_grad():
        for run, autocast, is_loss in runs:  # micro-batches of the step, in order
            rec = Recorder(model, backward)
            try:
                with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
                    outputs = run()
                if rec.first is not None:
                    name, inp, desc = rec.first
                    src = "its input already held NaN/Inf" if not inp else "from a finite input"
                    return Finding(step, "forward", name, inp,
                                   f"the first non-finite value comes out of {name} ({desc}); {src}.")
                loss = loss_value(outputs) if is_loss else None
                found = _after_forward(model, rec, outputs, loss, batch, loss_fn, backward, step, weights, user_loss)
            finally:
                rec.remove()
            if found.phase != "none":
                return found
    return found


def _after_forward(model: nn.Module, rec: Recorder, outputs: Any, loss: torch.Tensor | None, batch: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None, backward: bool, step: int, weights: str,
                   user_loss: bool) -> Finding:
    """Every module output of the replayed forward is finite: check the loss, then the backward."""
    if loss is None:
        try:
            loss = own_loss(outputs)
            if loss is None:
                loss = loss_fn(outputs, batch) if loss_fn is not None else (default_loss(outputs, batch) if batch is not None else None)
        except Exception:  # noqa: BLE001 - a loss_fn that needs the batch we do not have (step mode)
            loss = None
    if loss is not None and not finite(loss):
        return Finding(step, "loss", detail=f"every module output is finite but the loss computed from them is "
                                             f"{float(loss.detach().float().sum())}: the NaN/Inf arises in the loss function.")
    if not backward:
        return Finding(step, "none", detail=f"every module output is finite (backward replay off). {_not_found(step, weights, loss is not None, user_loss)}")
    target = loss if loss is not None else sum(t.float().sum() for _, t in float_tensors(outputs, "") if t.requires_grad)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not isinstance(target, torch.Tensor) or not target.requires_grad or not params:
        return Finding(step, "none", detail=f"every module output is finite and no gradient can be replayed. "
                                            f"{_not_found(step, weights, loss is not None, user_loss)}")
    grads = torch.autograd.grad(target, [p for _, p in params], allow_unused=True)
    param_ok: dict[str, bool] = {}
    for (n, _), g in zip(params, grads):
        if g is not None:
            layer = layer_of(n)
            param_ok[layer] = param_ok.get(layer, True) and bool(finite_flag(g))
    culprit = rec.backward_culprit(param_ok)
    if culprit is not None:
        return Finding(step, "backward", culprit, True, f"every forward value is finite; the first non-finite gradient "
                                                         f"is produced in the backward of {culprit}.")
    what = "the loss" if loss is not None else "the sum of the outputs"
    return Finding(step, "none", detail=f"the replay is finite in forward and in the backward of {what}. "
                                        f"{_not_found(step, weights, loss is not None, user_loss)}")


def _not_found(step: int, weights: str, real_loss: bool, user_loss: bool) -> str:
    """Why a finite replay names no culprit, said plainly."""
    exact = weights.startswith("the weights of step")
    causes = ["a transient fault (hardware, a race, a non-deterministic op)",
              "state the replay cannot restore (a counter, a random draw, a condition outside the model)"]
    if not exact:
        causes.insert(0, f"a fault that needs the exact weights of step {step} (this replay ran on {weights}; "
                         f"diag.probes.nan_replay.mode=step replays before the update)")
    if not real_loss:
        causes.append("a NaN/Inf made in the loss computation, which was not replayed (hand trackdiag your loss: "
                      "Diagnostics(..., loss_fn=lambda batch: ...))")
    elif not user_loss:
        causes.append("a loss computed differently from the guessed one (hand trackdiag yours: loss_fn=lambda batch: ...)")
    return (f"{NOT_FOUND}: the NaN/Inf of step {step} did not reappear when it was replayed on {weights}. Possible "
            f"causes: {'; '.join(causes)}. With diag.probes.flight.modules=true the hooks record every module's "
            f"output in the real step and name it.")

"""NaN root cause by replay: run one batch again with hooks on every module and find where the
first non-finite value appears.

``replay(model, calls, ...)`` re-runs the captured forward calls of the bad step (same arguments,
same autocast state) with a forward pre-hook and a forward hook on every module: the first module
(execution order, so the innermost) whose output holds a NaN/Inf is the culprit, and its input
tells whether the value was already there. When every output is finite, the loss (``loss_fn`` or
the guessed cross-entropy/MSE) and a backward pass (``torch.autograd.grad`` on the loss, or on the
sum of the outputs) locate a non-finite gradient: the innermost module whose output gradient is
finite but whose input or parameter gradients are not.

Side effects: none that survive. Parameters' ``.grad`` are never touched (``autograd.grad``), the
optimizer is not used, buffers (BatchNorm statistics) are restored, the RNG is forked, every hook is
removed and every module's ``training`` flag is put back. Cost: one forward (+ one backward) of one
batch, and one host sync per module and tensor (only when a replay runs).

If the parameters already hold NaN/Inf (the optimizer applied the bad step's gradients before the
fault was noticed), a replay would blame the first layer: this is detected and reported as such.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.gradtap import TAP_QUEUE
from trackdiag.isolation import eager, isolated
from trackdiag.layers import ROOT
from trackdiag.snapshot import ParamSnapshot
from trackdiag.tensors import default_loss, float_tensors

Call = tuple[tuple[Any, ...], dict[str, Any], tuple[str, torch.dtype] | None]  # args, kwargs, autocast


@dataclass(frozen=True)
class Finding:
    """What a replay found. ``phase``: ``forward`` | ``backward`` | ``loss`` | ``params`` | ``none``
    | ``unavailable`` | ``error``; ``module``: the culprit (``""`` when none)."""

    step: int
    phase: str
    module: str = ""
    input_finite: bool | None = None
    detail: str = ""

    def where(self, component: str = "", kind: str = "") -> str:
        """The alert's ``where``: ``encoder.3 (input finite)``, ``head (backward)``, ``loss function``;
        with the module's type ``kind`` (given for bare indices): ``0 (Linear, input finite)``."""
        mod = f"{component}.{self.module}" if component and self.module else (self.module or component)
        typed = f"{kind}, " if kind else ""
        if self.phase == "forward":
            return f"{mod} ({typed}input {'finite' if self.input_finite else 'non-finite'})"
        if self.phase == "backward":
            return f"{mod} ({typed}backward)"
        if self.phase == "loss":
            return "loss function"
        if self.phase == "params":  # the data is the cause when the bad step's input held NaN/Inf
            head = "input batch non-finite" if self.input_finite is False else mod
            return f"{head} ({typed if head == mod else ''}parameters already non-finite)"
        return ""


def _finite(obj: Any) -> bool:
    """True when no floating tensor in ``obj`` holds a NaN/Inf (one host sync per tensor)."""
    return all(bool(torch.isfinite(t).all()) for _, t in float_tensors(obj, ""))


def _describe(obj: Any) -> str:
    ts = [t for _, t in float_tensors(obj, "")]
    nan = sum(int(torch.isnan(t).sum()) for t in ts)
    inf = sum(int(torch.isinf(t).sum()) for t in ts)
    total = sum(t.numel() for t in ts)
    return f"{nan} NaN and {inf} Inf of {total} values"


def nonfinite_state(model: nn.Module) -> list[str]:
    """Names of the parameters that hold a NaN/Inf and of the buffers that hold a NaN (or an Inf in
    a normalisation running statistic). An infinite buffer value is otherwise legitimate: attention
    masks (``nn.Transformer.generate_square_subsequent_mask``) are made of ``-inf``."""
    params = [(n, t, True) for n, t in model.named_parameters()]
    buffers = [(n, b, n.endswith(("running_mean", "running_var"))) for n, b in model.named_buffers() if b.is_floating_point()]
    named = params + buffers
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


def _layer(name: str) -> str:
    head = name.rpartition(".")[0]
    return head or ROOT


class _Recorder:
    """Forward/backward hooks on every module of a model, recording finiteness in execution order."""

    def __init__(self, model: nn.Module, backward: bool) -> None:
        self.names = {m: (n or ROOT) for n, m in model.named_modules()}
        self.backward = backward
        self.first: tuple[str, bool, str] | None = None  # (module, input finite, description)
        self.order: dict[str, int] = {}
        self.in_ok: dict[str, bool] = {}
        self.grad_out: dict[str, list[torch.Tensor]] = {}
        self.grad_in: dict[str, list[torch.Tensor]] = {}
        self.handles: list[Any] = []
        for m in self.names:
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post))

    def _grad_hooks(self, store: dict[str, list[torch.Tensor]], name: str, obj: Any) -> None:
        for _, t in float_tensors(obj, ""):
            if t.requires_grad:
                with contextlib.suppress(RuntimeError):
                    t.register_hook(lambda g, n=name: store.setdefault(n, []).append(torch.isfinite(g).all()))

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        name = self.names[module]
        self.in_ok.setdefault(name, _finite((args, kwargs)))
        if self.backward:
            self._grad_hooks(self.grad_in, name, (args, kwargs))

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = self.names[module]
        self.order.setdefault(name, len(self.order))
        if self.first is None and not _finite(output):
            self.first = (name, self.in_ok.get(name, True), f"{type(module).__name__}; its output holds {_describe(output)}")
        if self.backward:
            self._grad_hooks(self.grad_out, name, output)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

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


def replay(model: nn.Module, calls: list[Call], *, step: int, batch: Any = None,
           loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, backward: bool = True,
           snapshot: ParamSnapshot | None = None) -> Finding:
    """Replay ``calls`` (captured forward arguments of step ``step``) on ``model``; see module doc.
    When the weights already hold NaN/Inf, the replay runs on ``snapshot`` (weights of an earlier,
    finite step) if there is one."""
    if not calls:
        return Finding(step, "unavailable", detail=f"no forward call of step {step} was captured.")
    with TAP_QUEUE.pause(), eager():
        bad_state = nonfinite_params(model)  # a training forward does not read BatchNorm's running stats
        if not bad_state:
            return _replay(model, calls, step, batch, loss_fn, backward)
        inputs_ok = _finite([c[:2] for c in calls])
        why = snapshot.refused if snapshot is not None and snapshot.refused else "no earlier weights were kept"
        if snapshot is not None and snapshot.step is not None and snapshot.step <= step:
            with snapshot.applied() as at:
                if not nonfinite_params(model):
                    found = _replay(model, calls, step, batch, loss_fn, backward)
                    return dataclasses.replace(found, detail=(
                        f"{found.detail} (replayed on the weights of step {at}, {step - at} step(s) before the bad "
                        f"step: by the time it was noticed, the optimizer had already written NaN/Inf into the weights.)"))
            why = f"the weights kept at step {snapshot.step} are not finite either"
        return Finding(step, "params", _layer(bad_state[0]), inputs_ok, (
            f"{len(bad_state)} parameter/buffer tensor(s) already hold NaN/Inf (first: {bad_state[0]}): the optimizer "
            f"applied the bad step's update before the fault was noticed, and {why}. The input batch was "
            f"{'finite' if inputs_ok else 'NON-finite'}. To replay before the update, set diag.probes.nan_replay.mode=step "
            f"(Python: probes={{'nan_replay': {{'mode': 'step'}}}}: one host sync per step)."))


def _replay(model: nn.Module, calls: list[Call], step: int, batch: Any,
            loss_fn: Callable[[Any, Any], torch.Tensor] | None, backward: bool) -> Finding:
    found = Finding(step, "none")
    with isolated(model), torch.enable_grad():
        for args, kwargs, autocast in calls:  # micro-batches of the step, in order
            rec = _Recorder(model, backward)
            try:
                with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
                    outputs = model(*args, **kwargs)
                if rec.first is not None:
                    name, inp, desc = rec.first
                    src = "its input already held NaN/Inf" if not inp else "from a finite input"
                    return Finding(step, "forward", name, inp,
                                   f"the first non-finite value comes out of {name} ({desc}); {src}.")
                found = _after_forward(model, rec, outputs, batch, loss_fn, backward, step)
            finally:
                rec.remove()
            if found.phase != "none":
                return found
    return found


def _after_forward(model: nn.Module, rec: _Recorder, outputs: Any, batch: Any,
                   loss_fn: Callable[[Any, Any], torch.Tensor] | None, backward: bool, step: int) -> Finding:
    """Every module output of the replayed forward is finite: check the loss, then the backward."""
    try:
        loss = loss_fn(outputs, batch) if loss_fn is not None else (default_loss(outputs, batch) if batch is not None else None)
    except Exception:  # noqa: BLE001 - a loss_fn that needs the batch we do not have (step mode)
        loss = None
    if loss is not None and not _finite(loss):
        return Finding(step, "loss", detail=f"every module output is finite but the loss computed from them is "
                                             f"{float(loss.detach().float().sum())}: the NaN/Inf arises in the loss function.")
    if not backward:
        return Finding(step, "none", detail="every module output is finite (backward replay off).")
    target = loss if loss is not None else sum(t.float().sum() for _, t in float_tensors(outputs, "") if t.requires_grad)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not isinstance(target, torch.Tensor) or not target.requires_grad or not params:
        return Finding(step, "none", detail="every module output is finite and no gradient can be replayed.")
    grads = torch.autograd.grad(target, [p for _, p in params], allow_unused=True)
    param_ok: dict[str, bool] = {}
    for (n, _), g in zip(params, grads):
        if g is not None:
            layer = _layer(n)
            param_ok[layer] = param_ok.get(layer, True) and bool(torch.isfinite(g).all())
    culprit = rec.backward_culprit(param_ok)
    if culprit is not None:
        return Finding(step, "backward", culprit, True, f"every forward value is finite; the first non-finite gradient "
                                                         f"is produced in the backward of {culprit}.")
    what = "the loss" if loss is not None else "the sum of the outputs (no loss_fn: the loss itself was not replayed)"
    return Finding(step, "none", detail=(
        f"the replay is finite in forward and in the backward of {what}: the non-finite value arises outside the model "
        f"(in the loss computation — pass loss_fn to the nan_replay probe — or from state not replayed)."))

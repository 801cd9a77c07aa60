"""Sanity pre-flight: cheap checks of the wiring of a training set-up, run on one batch.

``Diagnostics.preflight(batch, loss_fn=None)`` (and, with ``rules.preflight.auto: true`` as in the
``extreme`` preset, automatically at the first ``step()``) runs these checks and returns a
:class:`PreflightReport`; each failed check becomes a ``preflight`` alert whose ``where`` is
``<check>`` or ``<check>:<parameter>``:

  ``train_mode``     the model is in train mode (eval-mode submodules are listed, not failed);
  ``one_device``     parameters, buffers and the batch's tensors are on one device;
  ``finite_state``   no parameter holds NaN/Inf, no buffer NaN (``-inf`` attention masks are fine);
  ``optimizer``      every trainable parameter is in the optimizer, no frozen one is;
  ``forward``        the forward and the loss run and the loss is finite;
  ``grads``          every trainable parameter receives a finite gradient (a ``.detach()``, ``.data``
                     or ``no_grad`` on its path, or an unused module, shows up here);
  ``params_change``  one optimizer step changes every parameter that got a non-zero gradient;
  ``overfit``        ``overfit_steps`` steps on this one batch lower the loss by ``overfit_drop``
                     (relative); a loss that falls by less than a tenth of that fails, one that
                     falls slower than asked is only noted (a small learning rate needs longer).

Everything after ``optimizer`` runs on a deep copy of the model and a copy of the optimizer (same
class, hyperparameters and state): the user's model, optimizer, gradients and RNG stream are never
touched. Cost: one model + optimizer copy in memory while it runs, and 1 + ``overfit_steps``
training steps on one batch. The loss is ``loss_fn(outputs, batch)``, else cross-entropy/MSE when
the batch's targets allow (see :mod:`trackdiag.tensors`), else a surrogate (then ``overfit`` is
skipped). The model is called as ``forward(model, batch)``, default ``model(inputs_of(batch))``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.alert import Alert
from trackdiag.replay import nonfinite_state
from trackdiag.tensors import default_loss, float_tensors, inputs_of, iter_tensors

Forward = Callable[[nn.Module, Any], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class Check:
    """One pre-flight check: ``ok`` is True, False, or None (skipped or inconclusive: no alert)."""

    name: str
    ok: bool | None
    detail: str
    where: str = ""


@dataclass
class PreflightReport:
    """The checks in order; ``ok`` when none failed. ``str(report)`` is a readable table."""

    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def __getitem__(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def __str__(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "note"}
        return "\n".join(f"{mark[c.ok]} {c.name:<14} {c.detail}" for c in self.checks)

    def alerts(self, step: int, pinned: str | None, hint: str) -> list[Alert]:
        """One ``preflight`` alert per failed check. A check that failed on the model itself (the forward
        raised or gave NaN, NaN in the weights, tensors on several devices, trainable parameters in no
        optimizer) is ``unambiguous``; one that failed in the pre-flight's experiment on a copy (no
        gradient, no change, no fit on one batch) is one piece of evidence (``corroborated``)."""
        from trackdiag.policy import severity

        out = []
        for c in self.failed:
            ev = ("unambiguous",) if c.name in ("forward", "finite_state", "one_device", "optimizer") else ("corroborated",)
            out.append(Alert("preflight", step, pinned or severity(ev), c.detail, math.nan, math.nan,
                             f"{c.name}:{c.where}" if c.where else c.name, hint, ev, 1, step))
        return out


def _loss(outputs: Any, batch: Any, loss_fn: LossFn | None) -> tuple[torch.Tensor, bool]:
    """The loss and whether it is a real one (not the surrogate)."""
    if loss_fn is not None:
        return loss_fn(outputs, batch), True
    guessed = default_loss(outputs, batch)
    if guessed is not None:
        return guessed, True
    outs = [t.float().pow(2).mean() for _, t in float_tensors(outputs, "") if t.requires_grad]
    return (sum(outs[1:], outs[0]) if outs else torch.zeros(())), False


def copy_optimizer(opt: torch.optim.Optimizer, model: nn.Module, clone: nn.Module) -> torch.optim.Optimizer | None:
    """An optimizer of the same class and hyperparameters (and state) stepping ``clone``'s
    parameters; ``None`` when some of ``opt``'s parameters are not ``model``'s."""
    names = {id(p): n for n, p in model.named_parameters()}
    cparams = dict(clone.named_parameters())
    if any(id(p) not in names for g in opt.param_groups for p in g["params"]):
        return None
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [cparams[names[id(p)]] for p in g["params"]]}
              for g in opt.param_groups]
    try:
        new = type(opt)(groups, **opt.defaults)
    except TypeError:
        new = type(opt)(groups)
    try:  # a deep copy: load_state_dict would otherwise share the state tensors with the user's optimizer
        new.load_state_dict(copy.deepcopy(opt.state_dict()))
    except (ValueError, KeyError, RuntimeError):
        pass  # a fresh state is fine for these checks
    return new


_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _ours(hook: Any) -> bool:
    """A hook registered by trackdiag (a probe's bound method, a partial of one, a SafeHook)."""
    fn = getattr(hook, "func", hook)
    owner = getattr(fn, "__self__", None)
    module = type(owner).__module__ if owner is not None else (getattr(fn, "__module__", None) or type(fn).__module__)
    return module.startswith("trackdiag.")


def clone_model(model: nn.Module) -> nn.Module:
    """``copy.deepcopy(model)`` in which every trackdiag hook is a no-op (the probes are not copied)."""
    memo: dict[int, Any] = {}
    for m in model.modules():
        for attr in _HOOK_DICTS:
            for hook in getattr(m, attr, {}).values():
                if _ours(hook):
                    memo[id(hook)] = _noop
    return copy.deepcopy(model, memo)


def _noop(*_: Any, **__: Any) -> None:
    return None


def _static_checks(model: nn.Module, opt: Any, batch: Any) -> list[Check]:
    out = []
    evals = [n for n, m in model.named_modules() if n and not m.training]
    if not model.training:
        out.append(Check("train_mode", False, "the model is in eval mode during training: call model.train() "
                                              "(dropout and BatchNorm behave differently in eval mode)."))
    else:
        note = f" ({len(evals)} submodule(s) in eval mode, e.g. {', '.join(evals[:3])})" if evals else ""
        out.append(Check("train_mode", True, f"the model is in train mode{note}."))
    tensors = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()]] + list(iter_tensors(batch))
    devices = {t.device for _, t in tensors}
    if len(devices) > 1:
        home = tensors[0][1].device
        odd = next(n for n, t in tensors if t.device != home)
        out.append(Check("one_device", False, f"tensors on {len(devices)} devices ({', '.join(sorted(map(str, devices)))}): "
                                              f"'{odd}' is not on {home}.", odd))
    else:
        out.append(Check("one_device", True, f"everything on {next(iter(devices), 'no device')}."))
    bad = nonfinite_state(model)
    named_bad = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    out.append(Check("finite_state", not bad, f"{len(bad)} parameter/buffer tensor(s) hold NaN/Inf: {named_bad}." if bad
                     else "all finite (-inf attention masks allowed).", bad[0] if bad else ""))
    opts = [o for o in (opt if isinstance(opt, (list, tuple)) else [opt]) if o is not None]
    if not opts:
        out.append(Check("optimizer", None, "no optimizer given."))
        return out
    in_opt = {id(p) for o in opts for g in o.param_groups for p in g["params"]}  # every optimizer of the model
    named = list(model.named_parameters())
    missing = [n for n, p in named if p.requires_grad and id(p) not in in_opt]
    frozen = [n for n, p in named if not p.requires_grad and id(p) in in_opt]
    if missing:
        out.append(Check("optimizer", False, f"{len(missing)} trainable parameter(s) are not in the optimizer, "
                                             f"e.g. {missing[0]}: they get gradients but never change.", missing[0]))
    elif frozen:  # how fine-tuning freezes a backbone: a note, not a fault
        out.append(Check("optimizer", None, f"{len(frozen)} parameter(s) in the optimizer are frozen (requires_grad="
                                            f"False), e.g. {frozen[0]}: fine if on purpose (a frozen backbone)."))
    else:
        out.append(Check("optimizer", True, "every trainable parameter is in the optimizer."))
    return out


def run_preflight(model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None,
                  forward: Forward | None = None, *, overfit_steps: int = 30, overfit_drop: float = 0.1,
                  lenient: bool = False, reference: float | None = None) -> PreflightReport:
    """Run every check (see module docstring) and return the report. Never modifies its arguments.
    ``optimizer``: one, or a list (every optimizer of the model: the ``optimizer`` check covers them
    all, the experiments use the first). ``lenient`` (the automatic pre-flight): a forward or loss that
    cannot be run is inconclusive, not a failed check (the calling convention was guessed).
    ``reference``: the loss the training step itself computed on this batch; a guessed loss (no
    ``loss_fn``) that differs from it is not the task being trained (a VAE's reconstruction beside
    digit labels is no 64-class classifier), so the checks built on it are inconclusive."""
    report = PreflightReport(_static_checks(model, optimizer, batch))
    if isinstance(optimizer, (list, tuple)):
        optimizer = next((o for o in optimizer if o is not None), None)
    call = forward or (lambda m, b: m(inputs_of(b)))
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        clone = clone_model(model)
        opt = copy_optimizer(optimizer, model, clone) if optimizer is not None else None
        clone.zero_grad(set_to_none=True)
        try:
            loss, real = _loss(call(clone, batch), batch, loss_fn)
            loss0 = float(loss.detach())
        except Exception as exc:  # noqa: BLE001 - the check reports it
            report.checks.append(Check("forward", None if lenient else False,
                                       f"the forward or the loss raised {type(exc).__name__}: {exc}"
                                       + (" (automatic pre-flight: pass forward=/loss_fn= to diag.preflight to check it)"
                                          if lenient else "")))
            return report
        what = "loss" if real else "surrogate loss (no loss_fn and no targets to guess one)"
        report.checks.append(Check("forward", math.isfinite(loss0), f"{what} = {loss0:.4g}."))
        if not math.isfinite(loss0):
            return report
        if loss_fn is None and reference is not None and not (real and _same(loss0, reference)):
            report.checks.append(Check("loss", None, f"the guessed {what} ({loss0:.4g}) is not the training step's "
                                                     f"({reference:.4g}): pass forward=/loss_fn= to diag.preflight to "
                                                     f"check the training itself."))
            return report
        if not loss.requires_grad:
            report.checks.append(Check("grads", False, "the loss does not require grad: no trainable parameter is on its "
                                                       "path (all frozen, or the graph is cut by .detach()/no_grad)."))
            return report
        loss.backward()
        report.checks.append(_grad_check(model, clone))
        if opt is None:
            return report
        report.checks.append(_change_check(model, clone, opt))
        report.checks.append(_overfit(clone, opt, batch, call, loss_fn, real, loss0, overfit_steps, overfit_drop))
    return report


def _same(a: float, b: float, tol: float = 0.02) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def _grad_check(model: nn.Module, clone: nn.Module) -> Check:
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    none = [n for n, p in clone.named_parameters() if n in trainable and p.grad is None]
    if none:
        return Check("grads", False, f"{len(none)} trainable parameter(s) get no gradient, e.g. {none[0]}: not used in "
                                     f"the forward, or cut from the loss (.detach(), .data, torch.no_grad, a NumPy round-trip).", none[0])
    bad = [n for n, p in clone.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    if bad:
        return Check("grads", False, f"{len(bad)} gradient(s) hold NaN/Inf on this batch, e.g. {bad[0]}.", bad[0])
    return Check("grads", True, f"all {len(trainable)} trainable parameter(s) get a finite gradient.")


def _change_check(model: nn.Module, clone: nn.Module, opt: torch.optim.Optimizer) -> Check:
    if all(float(g.get("lr", 1.0)) == 0.0 for g in opt.param_groups):
        opt.step()
        return Check("params_change", None, "the learning rate is 0 (warm-up start?): nothing can change yet.")
    moved = {n: bool(p.grad is not None and p.grad.any()) for n, p in clone.named_parameters()}
    opt.step()
    original = dict(model.named_parameters())
    stuck = [n for n, p in clone.named_parameters() if moved[n] and torch.equal(p.detach(), original[n].detach())]
    if stuck:
        return Check("params_change", False, f"{len(stuck)} parameter(s) with a non-zero gradient did not change after an "
                                             f"optimizer step, e.g. {stuck[0]} (a learning rate of 0 for its group?).", stuck[0])
    return Check("params_change", True, "one optimizer step changes every parameter with a gradient.")


def _overfit(clone: nn.Module, opt: torch.optim.Optimizer, batch: Any, call: Forward, loss_fn: LossFn | None,
             real: bool, loss0: float, steps: int, drop: float) -> Check:
    if steps <= 0 or not real:
        return Check("overfit", None, "skipped" + ("" if real else ": no loss_fn and no targets to guess a loss."))
    last = loss0
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss, _ = _loss(call(clone, batch), batch, loss_fn)
        loss.backward()
        opt.step()
        last = float(loss.detach())
        if not math.isfinite(last):
            break
    target = loss0 - drop * abs(loss0)
    progress = (loss0 - last) / (drop * abs(loss0)) if math.isfinite(last) and loss0 != 0 else -math.inf
    what = f"{steps} steps on this one batch took the loss from {loss0:.4g} to {last:.4g} (needed <= {target:.4g})"
    if progress >= 1.0:
        return Check("overfit", True, f"{what}.")
    if progress >= 0.1:  # falling, just slowly: the user's learning rate, not a wiring fault
        return Check("overfit", None, f"{what}: falling, but slower than a one-batch fit usually does "
                                      f"({progress:.0%} of the drop); fine for a small learning rate.")
    return Check("overfit", False, f"{what}: the model cannot fit one batch — check the labels, the loss, the learning rate.")

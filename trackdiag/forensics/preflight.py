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
                     or ``no_grad`` on its path, or an unused module, shows up here); children of a
                     ``ModuleList``/``ModuleDict`` the batch never called while a sibling was called
                     (experts of a mixture, conditional branches) are noted, not failed;
  ``params_change``  one optimizer step changes every parameter that got a non-zero gradient;
  ``overfit``        ``overfit_steps`` steps on this one batch lower the loss by ``overfit_drop``
                     (relative; the median loss of the last quarter of the steps: a high rate with
                     momentum oscillates); a loss that falls by less than a tenth of that fails, one
                     that falls slower than asked is only noted (a small learning rate needs longer).

Everything after ``optimizer`` runs on a deep copy of the model and a copy of the optimizer (same
class, hyperparameters and state): the user's model, optimizer, gradients and RNG stream are never
touched (:mod:`trackdiag.forensics.preflight_trial`). Cost: one model + optimizer copy in memory while it runs,
and 1 + ``overfit_steps`` training steps on one batch. The loss is the session's ``loss_fn(batch)``
(the user's own computation, run with the models' tensors swapped for the copies': several inputs,
a model that returns its loss, several models and optimizers all work), else ``loss_fn(outputs,
batch)`` on ``forward(model, batch)`` (default ``model(inputs_of(batch))``), else the model's own
loss (a 0-d output, ``.loss``), else cross-entropy/MSE when the batch's targets allow (see
:mod:`trackdiag.util.tensors`), else a surrogate (then ``overfit`` is skipped). Sparse gradients
(``EmbeddingBag(sparse=True)``) are checked through their stored values.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from trackdiag.capture.isolation import rngs_kept
from trackdiag.core.alert import Alert
from trackdiag.core.errors import brief
from trackdiag.forensics.preflight_trial import Forward, LossFn, Trial, clone_model, copy_optimizer  # noqa: F401 (re-exported)
from trackdiag.forensics.replay import nonfinite_state
from trackdiag.util.sparse import all_finite, any_nonzero, dense
from trackdiag.util.tensors import iter_tensors


@dataclass
class Check:
    """One pre-flight check: ``ok`` is True, False, or None (skipped or inconclusive: no alert)."""

    name: str
    ok: bool | None
    detail: str
    where: str = ""
    #: a failed one-batch fit at a learning rate so small the weights barely moved: a schedule's first value would
    #: make it inconclusive, so the automatic pre-flight waits for the next step to see whether the rate moves
    slow: bool = False


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

    def alerts(self, step: int, pinned: str | None, hint: str, checks: list[Check] | None = None) -> list[Alert]:
        """One ``preflight`` alert per failed check (of ``checks``, default all). A check that failed on the
        model itself (the forward raised or gave NaN, NaN in the weights, tensors on several devices, trainable
        parameters in no optimizer) is ``unambiguous``; one that failed in the pre-flight's experiment on a copy
        (no gradient, no change, no fit on one batch) is one piece of evidence (``corroborated``)."""
        from trackdiag.core.policy import severity

        out = []
        for c in self.failed if checks is None else [c for c in checks if c.ok is False]:
            ev = ("unambiguous",) if c.name in ("forward", "finite_state", "one_device", "optimizer") else ("corroborated",)
            out.append(Alert("preflight", step, pinned or severity(ev), c.detail, math.nan, math.nan,
                             f"{c.name}:{c.where}" if c.where else c.name, hint, ev, 1, step))
        return out


def _static_checks(model: nn.Module, opts: list[torch.optim.Optimizer], batch: Any) -> list[Check]:
    out = []
    evals = [n for n, m in model.named_modules() if n and not m.training]
    stepped = {id(q) for o in opts for g in o.param_groups for q in g["params"]}
    steps_model = any(id(p) in stepped for p in model.parameters())
    if not model.training and opts and not steps_model:  # an input optimised: the fixed model is meant to be in eval
        out.append(Check("train_mode", None, "the model is in eval mode; the optimizer steps no parameter of it (an "
                                             "input optimised), so it is meant to stay fixed."))
    elif not model.training:
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
    if not opts:
        out.append(Check("optimizer", None, "no optimizer given."))
        return out
    in_opt = {id(p) for opt in opts for g in opt.param_groups for p in g["params"]}
    named = list(model.named_parameters())
    outside = [(n, p) for n, p in named if p.requires_grad and id(p) not in in_opt]
    # the automatic pre-flight runs at the first step, after its backward pass: a parameter the optimizer does not
    # hold that got a gradient is a mistake; one without a gradient while others have theirs may be updated by hand
    # (an EMA codebook that a VQ-VAE's forward re-creates as a new nn.Parameter at every call)
    backward_seen = any(p.grad is not None for _, p in named)  # else (called before training) no evidence either way
    missing = [n for n, p in outside if p.grad is not None or not backward_seen]
    frozen = [n for n, p in named if not p.requires_grad and id(p) in in_opt]
    if missing and in_opt and not any(id(p) in in_opt for _, p in named):  # it steps an input, not the model
        out.append(Check("optimizer", None, f"the optimizer steps {len(in_opt)} tensor(s) that are not the model's "
                                            f"parameters (an input optimised): the model is held fixed; its "
                                            f"{len(missing)} trainable parameter(s) get gradients that are never used."))
    elif missing:
        out.append(Check("optimizer", False, f"{len(missing)} trainable parameter(s) are not in the optimizer, "
                                             f"e.g. {missing[0]}: they get gradients but never change.", missing[0]))
    elif outside:
        out.append(Check("optimizer", None, f"{len(outside)} parameter(s) that require grad are not in the optimizer "
                                            f"and have no gradient at this step, e.g. {outside[0][0]}: not trained by it "
                                            f"(fine if updated by hand, as an EMA codebook is; param_not_optimized "
                                            f"watches whether they get gradients)."))
    elif frozen:  # how fine-tuning freezes a backbone: a note, not a fault
        out.append(Check("optimizer", None, f"{len(frozen)} parameter(s) in the optimizer are frozen (requires_grad="
                                            f"False), e.g. {frozen[0]}: fine if on purpose (a frozen backbone)."))
    else:
        out.append(Check("optimizer", True, "every trainable parameter is in the optimizer."))
    return out


def run_preflight(model: nn.Module, optimizer: Any, batch: Any, loss_fn: LossFn | None = None,
                  forward: Forward | None = None, *, overfit_steps: int = 30, overfit_drop: float = 0.1,
                  lenient: bool = False, batch_loss: Callable[[Any], Any] | None = None,
                  parts: list[tuple[str, nn.Module, Any]] | None = None, reference: float | None = None,
                  ramp: bool = False) -> PreflightReport:
    """Run every check (see module docstring) and return the report. Never modifies its arguments.
    ``lenient`` (the automatic pre-flight): a forward or loss that cannot be run is inconclusive, not a
    failed check (the calling convention was guessed). ``batch_loss(batch)``: the user's loss
    computation, evaluated with every model of ``parts`` (default: ``model`` alone) on its copy.
    ``optimizer`` (and each part's): one optimizer, a list of them (``SparseAdam`` + ``Adam``), or None.
    ``reference``: the loss the training step itself computed on this batch; a guessed loss (no
    ``loss_fn``) that differs from it is not the task being trained (a VAE's reconstruction beside
    digit labels is no 64-class classifier), so the checks built on it are inconclusive. ``ramp``: the
    optimizers' learning rate is the first value of a schedule (a warm-up from ~0, an LR range test): a one-batch
    fit that barely moved the weights at it is inconclusive, not a failure (without ``ramp``, such a failure is
    marked ``slow``: the caller may wait for the next step's rate before calling it one)."""
    parts = [(n, m, _listed(o)) for n, m, o in (parts or [("", model, optimizer)])]
    report = PreflightReport([c for name, m, o in parts for c in _prefixed(name, len(parts) > 1, _static_checks(m, o, batch))])
    devices = sorted({p.device.index or 0 for _, m, _ in parts for p in m.parameters() if p.device.type == "cuda"})
    with rngs_kept(devices), torch.enable_grad():
        trial = Trial(parts, batch, loss_fn=loss_fn, forward=forward, batch_loss=batch_loss)
        with trial.swapped():
            for clone in trial.clones:
                clone.zero_grad(set_to_none=True)
            try:
                with trial.calls_seen() as seen:
                    loss, real = trial.loss()
                loss0 = float(loss.detach())
            except Exception as exc:  # noqa: BLE001 - the check reports it
                report.checks.append(Check("forward", None if lenient else False,
                                           f"the forward or the loss raised {brief(exc)}"
                                           + (" (automatic pre-flight: pass loss_fn=lambda batch: ... to the session to "
                                              "check it)" if lenient else "")))
                return report
            what = "loss" if real else "surrogate loss (no loss_fn and no targets to guess one)"
            guessed = loss_fn is None and batch_loss is None
            if guessed and not math.isfinite(loss0) and reference is not None and math.isfinite(reference):
                report.checks.append(Check("forward", None, f"the guessed {what} is {loss0:.4g} where the training step's is "
                                                            f"{reference:.4g} (targets the loop masks: NaN for a missing label?): "
                                                            f"give the session loss_fn=lambda batch: ... to check the training itself."))
                return report
            report.checks.append(Check("forward", math.isfinite(loss0), f"{what} = {loss0:.4g}."))
            if not math.isfinite(loss0):
                return report
            if guessed and reference is not None and not (real and _same(loss0, reference)):
                report.checks.append(Check("loss", None, f"the guessed {what} ({loss0:.4g}) is not the training step's "
                                                         f"({reference:.4g}): give the session loss_fn=lambda batch: ... "
                                                         f"to check the training itself."))
                return report
            if not loss.requires_grad:
                report.checks.append(Check("grads", False, "the loss does not require grad: no trainable parameter is on "
                                                           "its path (all frozen, or the graph is cut by .detach()/no_grad)."))
                return report
            loss.backward()
            report.checks.append(_grad_check(trial, seen))
            if not trial.opts or any(o is None for o in trial.opts):
                return report
            report.checks.append(_change_check(trial))
            report.checks.append(_overfit(trial, real, loss0, overfit_steps, overfit_drop, ramp))
    return report


def _same(a: float, b: float, tol: float = 0.02) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tol * max(abs(a), abs(b), 1e-12)


def _listed(opt: Any) -> list[Any]:
    return [] if opt is None else [o for o in opt if o is not None] if isinstance(opt, (list, tuple)) else [opt]


def _prefixed(name: str, multi: bool, checks: list[Check]) -> list[Check]:
    """With several models, each static check names its model."""
    if not multi:
        return checks
    return [Check(c.name, c.ok, f"{name}: {c.detail}", f"{name}.{c.where}" if c.where else name) for c in checks]


def _named(trial: Trial) -> list[tuple[str, nn.Parameter, nn.Parameter]]:
    """(report name, original parameter, its copy) for every trainable parameter of every model."""
    out = []
    for i, (originals, clone) in enumerate(zip(trial.originals, trial.clones)):
        copies = dict(clone.named_parameters())
        out += [(trial.named(i, n), p, copies[n]) for n, p in originals if n in copies]
    return out


def _grad_check(trial: Trial, seen: set[int] | None) -> Check:
    named = _named(trial)
    routed = _routed(trial, seen)
    none = [n for n, _, c in named if c.grad is None and n not in routed]
    if none:
        return Check("grads", False, f"{len(none)} trainable parameter(s) get no gradient, e.g. {none[0]}: not used in "
                                     f"the forward, or cut from the loss (.detach(), .data, torch.no_grad, a NumPy round-trip).", none[0])
    bad = [n for n, _, c in named if c.grad is not None and not all_finite(c.grad)]  # sparse gradients by their values
    if bad:
        return Check("grads", False, f"{len(bad)} gradient(s) hold NaN/Inf on this batch, e.g. {bad[0]}.", bad[0])
    if routed:
        return Check("grads", None, f"{len(routed)} trainable parameter(s) of ModuleList/ModuleDict entries this batch "
                                    f"never called while their siblings ran got no gradient, e.g. {min(routed)} (routed "
                                    f"or conditional branches, mixture-of-experts): not judged on one batch; every other "
                                    f"parameter gets a finite gradient.")
    return Check("grads", True, f"all {len(named)} trainable parameter(s) get a finite gradient.")


def _routed(trial: Trial, seen: set[int] | None) -> set[str]:
    """Report names of the trainable parameters of ``ModuleList``/``ModuleDict`` children the batch
    never called while a sibling was called: a branch not taken (an expert no token was routed to),
    not a cut graph (a block whose output was detached was still called). Empty when the calls are
    unknown (a compiled model)."""
    out: set[str] = set()
    for i, clone in enumerate(trial.clones):
        called = trial.called(i, seen)
        if not called:
            continue
        for prefix, box in clone.named_modules():
            if not isinstance(box, (nn.ModuleList, nn.ModuleDict)):
                continue
            kids = {f"{prefix}.{child}" if prefix else child: mod for child, mod in box.named_children()}
            if not any(name in called for name in kids):
                continue
            for name, mod in kids.items():
                if name not in called:
                    out.update(trial.named(i, f"{name}.{n}") for n, p in mod.named_parameters() if p.requires_grad)
    return out


def _visible(param: torch.Tensor, lr: float) -> bool:
    """Whether an SGD step of ``lr`` on ``param``'s gradient is above fp32 resolution of its largest weight."""
    g, w = dense(param.grad.detach()), dense(param.detach())
    top = float(w.abs().max()) if w.numel() else 0.0
    return lr * float(g.abs().max()) > 1e-6 * max(top, 1e-30)


def _change_check(trial: Trial) -> Check:
    opts = [o for o in trial.opts if o is not None]
    if all(float(g.get("lr", 1.0)) == 0.0 for o in opts for g in o.param_groups):
        for o in opts:
            o.step()
        return Check("params_change", None, "the learning rate is 0 (warm-up start?): nothing can change yet.")
    named = _named(trial)
    lr = max((float(g.get("lr", 1.0)) for o in opts for g in o.param_groups), default=1.0)
    # a gradient whose plain step (lr x g) is below fp32 resolution of the weight moves nothing under SGD: a block
    # behind a zero-initialised gain (torchvision's zero_init_residual) gets a rounding-level gradient, not a stuck one
    moved = {n: bool(c.grad is not None and any_nonzero(c.grad) and _visible(c, lr)) for n, _, c in named}
    for o in opts:
        o.step()
    stuck = [n for n, p, c in named if moved[n] and torch.equal(dense(c.detach()), dense(p.detach()))]
    if stuck:
        return Check("params_change", False, f"{len(stuck)} parameter(s) with a non-zero gradient did not change after an "
                                             f"optimizer step, e.g. {stuck[0]} (a learning rate of 0 for its group?).", stuck[0])
    return Check("params_change", True, "one optimizer step changes every parameter with a gradient.")


def _overfit(trial: Trial, real: bool, loss0: float, steps: int, drop: float, ramp: bool = False) -> Check:
    if steps <= 0 or not real:
        return Check("overfit", None, "skipped" + ("" if real else ": no loss_fn and no targets to guess a loss."))
    losses = [loss0]
    opts = [o for o in trial.opts if o is not None]
    for _ in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss, _ = trial.loss()
        loss.backward()
        for o in opts:
            o.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            break
    # the median of the last quarter of the steps: full-batch steps at a high rate with momentum oscillate (SGDR's
    # Nesterov at 0.05 read 0.97, 0.90, 0.83, 0.74, 0.67, 0.89, 3.07 at steps 24-30 on a batch it fits: the last one
    # alone failed); one spike does not move it, and a loss that cannot fall (fresh random labels each call, whose
    # lowest reading of a few falls below the target by chance) stays where it was
    tail = losses[-max(3, steps // 4):]
    last = statistics.median(tail) if all(math.isfinite(v) for v in tail) else math.nan
    target = loss0 - drop * abs(loss0)
    progress = (loss0 - last) / (drop * abs(loss0)) if math.isfinite(last) and loss0 != 0 else -math.inf
    what = (f"{steps} steps on this one batch took the loss from {loss0:.4g} to {last:.4g} (the median of the last "
            f"{len(tail)}; needed <= {target:.4g})")
    if progress >= 1.0:
        return Check("overfit", True, f"{what}.")
    if progress >= 0.1:  # falling, just slowly: the user's learning rate, not a wiring fault
        return Check("overfit", None, f"{what}: falling, but slower than a one-batch fit usually does "
                                      f"({progress:.0%} of the drop); fine for a small learning rate.")
    named = _named(trial)  # how far the copies moved from the model's own weights (untouched: no copy kept for it)
    moved = _moved([c for _, _, c in named], [p for _, p, _ in named])
    lr = max((float(g.get("lr", 0.0)) for o in opts for g in o.param_groups), default=0.0)
    if moved < STILL and ramp:  # the first value of a schedule (a warm-up from ~0, an LR range test): nothing to judge yet
        return Check("overfit", None, f"{what}, but the weights moved only {moved:.1e} of their size at the learning "
                                      f"rate the schedule starts from ({lr:.3g}): too little to tell.")
    if moved < STILL:
        return Check("overfit", False, f"{what}, and the weights moved only {moved:.1e} of their size at a learning rate "
                                       f"of {lr:.3g}: the model cannot fit one batch — check the learning rate (too "
                                       f"small?), the labels, the loss.", slow=True)
    return Check("overfit", False, f"{what}: the model cannot fit one batch — check the labels, the loss, the learning rate.")


#: the overfit trial's weights moved less than this share of their size: its learning rate is too small to judge
#: (30 Adam steps at 1e-3 move a default-initialised MLP's weights by ~30-60 % of their size; a LinearLR warm-up's
#: first rate, 1e-3 of that, by ~0.5 %)
STILL = 0.02


def _moved(params: list[torch.Tensor], start: list[torch.Tensor]) -> float:
    """||w - w0|| / ||w0|| of the trial's copies ``params`` against the model's weights ``start`` (host read;
    pre-flight only)."""
    if not params:
        return math.inf
    with torch.no_grad():
        delta = sum(float(torch.linalg.vector_norm(dense(p.detach()).float() - dense(s).float())) ** 2
                    for p, s in zip(params, start))
        size = sum(float(torch.linalg.vector_norm(dense(s).float())) ** 2 for s in start)
    return math.sqrt(delta) / math.sqrt(size) if size > 0 else (math.inf if delta > 0 else 0.0)

"""Shared pieces of the breadth corpus: the run result, the session a README user would build, the
NaN gate, data helpers and the fault switches every style plants the same way.

Each style module exposes ``NAME``, ``DESCRIPTION``, ``FAULTS`` and
``run(out, *, level, seed, steps, fault, onset, **diag_overrides) -> StyleRun``. Faults:

- ``nan``: a NaN made inside a named module (``NanGate``: log(0) - log(0)) from ``onset``;
  ``StyleRun.culprit`` is that module's name as trackdiag names layers.
- ``lr1000`` / ``lr_start``: every learning rate x1000 from ``onset`` / from step 0.
- ``no_zero``: ``zero_grad`` dropped from ``onset``.
- ``shuffled_labels``: targets shuffled within each batch from step 0 (the run cannot learn).
- ``eval_mode``: ``model.eval()`` left on before the loop (a model with Dropout/BatchNorm).
- ``wiped_grads``: gradients wiped between backward and step from ``onset``
  (``clip_grad_norm_(..., max_norm=0)``).
- ``tiny_subset``: one or two batches trained on from step 0 (overfitting), ``log_eval`` every 20.
- ``crash_nan``: a NaN from ``onset`` that makes the script itself raise before ``diag.step``.
- ``same_batch``: from ``onset`` the loader is restarted every step (``next(iter(loader))`` in the loop on an
  unshuffled loader): every step gets fresh copies of the same batch (``restart_loader``).

Silent faults (issue 45; the run neither crashes nor explodes at first):

- ``runaway``: from ``onset`` a regulariser (the squared norm of one layer's weight) enters the minimised loss
  with a weight annealed below zero (``loss - beta * ||W||^2``, ``beta`` growing by one unit a step, a unit
  set so that the term equals the run's first loss three steps in): the loss falls without bound (``Runaway``).
- ``detached``: from step 0 a stray ``.detach()`` on the output of the style's gated layer (``NanGate.cut``):
  that layer and everything before it never receive a gradient while the rest trains.
- ``frozen_majority``: from step 0 every parameter tensor but the last has ``requires_grad=False`` (an
  off-by-one meant to freeze a backbone: ``list(model.parameters())[:-1]``) while the optimizer holds them
  all (``freeze_all_but_last``).
- ``not_landing``: from step 0 the optimizer steps tensors the model no longer uses: every layer's
  parameters replaced by copies after the optimizer was built (``orphan_params``).
- ``eval_wrong``: from step 0 the evaluation runs on a copy of the model made before training and never
  refreshed (``StaleEval``: ``eval_model = copy.deepcopy(model)`` before the loop, evaluated throughout).
- ``dup_workers``: from step 0 every batch arrives twice in a row, the second a fresh copy, as an ``IterableDataset``
  read by two DataLoader workers that each yield the whole stream gives it (``restart_loader``).
- ``crash_lr``: every learning rate x1e6 from ``onset`` (``lr=1e3`` typed for ``1e-3``), and the script stops itself
  once the loss is not finite, as DETR's and MAE's loops do (``stop_if_nonfinite``).
- ``reversed_ema``: from ``onset``, after each optimizer step, a reversed EMA update pulls the trained weights
  toward a copy taken at the onset and never updated (``p.copy_(decay * ema_p + (1 - decay) * p)`` into the model
  instead of the EMA copy; ``PullBack``): the weights move between optimizer steps and training stalls.
- ``sorted_data``: from step 0 the training set is read in label order without shuffling, as a dataset stored class
  by class (``ImageFolder``) behind ``DataLoader(shuffle=False)`` gives it (``batches(..., sort=True)``).
- ``sched_per_batch``: from step 0 every learning rate x0.1 every 30 steps, as ``StepLR(step_size=30, gamma=0.1)`` meant
  per epoch and stepped per batch gives it (the :func:`lr_jump` hook with :func:`jump_factor` 0.1): under 1e-4 of the
  peak from step 150.
- ``zero_inputs``: from ``onset`` the model input of every batch is zeros (its float input: the batch, ``batch[0]``
  or a dict's ``input``/``image``... key), as an integer division in the preprocessing (``uint8 // 255``) or a loader
  that returns a placeholder for unreadable images gives it (``restart_loader``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import trackdiag  # noqa: E402
from _harness import SEVERITY, Judged, local_session, one_thread, quiet_probes  # noqa: E402,F401  (re-exported for the styles)
from _zoo_a import digits  # noqa: E402,F401  (re-exported for the styles)

#: faults that are present from step 0 (their onset is 0 whatever ``onset`` says)
START_FAULTS = frozenset({"lr_start", "shuffled_labels", "eval_mode", "tiny_subset", "detached", "frozen_majority",
                          "not_landing", "eval_wrong", "dup_workers", "sorted_data", "sched_per_batch"})
ALL_FAULTS = ("nan", "lr1000", "no_zero", "lr_start", "shuffled_labels", "eval_mode", "wiped_grads",
              "tiny_subset", "crash_nan", "same_batch", "runaway", "detached", "frozen_majority", "not_landing",
              "eval_wrong", "crash_lr", "reversed_ema", "dup_workers", "sorted_data", "sched_per_batch", "zero_inputs")
#: the alert kind each silent fault is judged by (the first warning-or-worse alert must be of it)
SILENT_KINDS = {"runaway": "loss_runaway", "detached": "stale_params", "frozen_majority": "stale_params",
                "not_landing": "grads_missing", "eval_wrong": ("eval_mismatch", "eval_frozen"), "crash_lr": "crash",
                "dup_workers": "repeated_batches", "reversed_ema": "weights_moved", "sorted_data": "class_sorted_batches",
                "sched_per_batch": "lr_vanished", "zero_inputs": "constant_inputs"}
ZERO_INPUTS = ("from the onset the model input is zeros, as an integer division in the preprocessing (uint8 // 255) or a "
               "loader's placeholder for unreadable images gives it")
DUP_WORKERS = ("an IterableDataset read by 2 DataLoader workers, each yielding the whole stream: every batch twice in a "
               "row, from step 0")
SAME_BATCH = "the loader restarted every step from onset (next(iter(loader)) in the loop): one batch, fresh copies"
SORTED_DATA = "the training set stored class by class and read with shuffle=False: each batch one class, from step 0"


@dataclasses.dataclass
class Progress:
    """Evidence that the run learned: ``metric`` early vs late (``end`` beats ``start`` by more than
    ``min_gain`` in the right direction)."""

    metric: str
    start: float
    end: float
    higher_is_better: bool = False
    min_gain: float = 0.0

    @property
    def learned(self) -> bool:
        gain = (self.end - self.start) if self.higher_is_better else (self.start - self.end)
        return gain > self.min_gain


@dataclasses.dataclass
class StyleRun(Judged):
    diag: Any                 # the session (or the Lightning callback): .alerts, .summary()
    onset: int                # the step the fault starts (0 for START_FAULTS, -1 healthy)
    steps: int
    culprit: str = ""         # the module a ``nan`` fault is planted in
    fault: str | None = None
    progress: Progress | None = None
    error: str | None = None  # what the script died of (crash faults, a blow-up), else None
    seconds: float = 0.0


def session(model: Any, opt: Any, out: Path | str, level: str, **overrides: Any) -> trackdiag.Diagnostics:
    """``Diagnostics`` as the README's quick start builds it (:func:`_harness.local_session`)."""
    return local_session(model, opt, out, level, **overrides)


class NanGate(nn.Module):
    """Wraps a module; while the ``fault`` buffer is 1 its output gets ``log(0) - log(0)`` (NaN)
    added. A buffer, so a replay on earlier weights sees the same switch."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("fault", torch.zeros(()), persistent=False)
        self.armed = False  # mirrors the buffer: the healthy graph stays exactly the style's
        self.cut = False  # the ``detached`` fault: a stray .detach() on this module's output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)
        if self.cut:
            out = (out[0].detach(), *out[1:]) if isinstance(out, tuple) else out.detach()
        if not self.armed:
            return out
        bad = torch.log1p(-self.fault)  # log(1 - 1) = log(0) = -inf when armed
        if isinstance(out, tuple):
            return (out[0] + (bad - bad), *out[1:])
        return out + (bad - bad)

    def arm(self, on: bool) -> None:
        if on != self.armed:
            self.fault.fill_(1.0 if on else 0.0)
            self.armed = on


def check_fault(fault: str | None, faults: dict[str, str]) -> None:
    if fault is not None and fault not in faults:
        raise ValueError(f"fault {fault!r} is not supported here; supported: {sorted(faults)}")


def fault_onset(fault: str | None, onset: int) -> int:
    if fault is None:
        return -1
    return 0 if fault in START_FAULTS else onset


def active(fault: str | None, name: str, step: int, onset: int) -> bool:
    """Whether fault ``name`` is planted at ``step``."""
    return fault == name and (step >= onset or name in START_FAULTS)


#: ``crash_lr``'s factor: the exponent's sign lost in a config (``lr=1e3`` typed for ``1e-3``). At x1000 Adam keeps
#: the loss finite in all but 5 styles (its update is ~lr whatever the gradient); at x1e6 15 of 31 die
CRASH_LR_FACTOR = 1e6


#: ``sched_per_batch``: every this many steps the learning rates x0.1 (``StepLR(step_size=30)`` stepped per batch)
SCHED_PERIOD = 30


def jump_factor(fault: str | None) -> float:
    """The factor every learning rate is multiplied by at the jump: ``CRASH_LR_FACTOR`` under ``crash_lr``, 0.1 under
    ``sched_per_batch``, else 1000 (``lr1000``, ``lr_start``)."""
    return CRASH_LR_FACTOR if fault == "crash_lr" else 0.1 if fault == "sched_per_batch" else 1000.0


def lr_jump(fault: str | None, step: int, onset: int) -> bool:
    """Whether the loop multiplies every learning rate by :func:`jump_factor` at ``step`` (``lr1000``, ``crash_lr``
    at the onset; ``sched_per_batch`` every :data:`SCHED_PERIOD` steps)."""
    if fault == "sched_per_batch":
        return step > 0 and step % SCHED_PERIOD == 0
    return fault in ("lr1000", "crash_lr") and step == onset


def stop_if_nonfinite(fault: str | None, loss: torch.Tensor) -> None:
    """The ``crash_lr`` script's own check (DETR's and MAE's ``if not math.isfinite(loss_value): sys.exit(1)``,
    raised here): only under that fault, so the healthy loop has no extra host copy."""
    if fault == "crash_lr" and not bool(torch.isfinite(loss.detach()).all()):
        raise RuntimeError(f"Loss is {loss.detach().flatten()[0].item()}, stopping training")


class Runaway:
    """The ``runaway`` fault: ``loss - beta * ||weight||^2`` from ``onset``, ``beta`` annealed below zero by one
    unit a step, the unit set at ``onset`` so that the term equals the run's first loss three steps in (the
    same strength in every style, whatever its loss scale; a steeper one makes the gradient jump 10x at once,
    which ``grad_explosion`` says first). Healthy and other faults: ``loss`` itself."""

    def __init__(self, fault: str | None, onset: int, weight: torch.Tensor) -> None:
        self.on, self.onset, self.weight = fault == "runaway", onset, weight
        self.first: float | None = None
        self.unit = 0.0

    def __call__(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        if not self.on:
            return loss
        if self.first is None:
            self.first = abs(float(loss.detach()))
        if step < self.onset:
            return loss
        reg = self.weight.pow(2).sum()
        if not self.unit:
            self.unit = self.first / max(float(reg.detach()), 1e-12) / 3
        return loss - self.unit * (step - self.onset + 1) * reg


def freeze_all_but_last(model: nn.Module, fault: str | None) -> None:
    """The ``frozen_majority`` fault: ``requires_grad=False`` on every parameter tensor but the last."""
    if fault == "frozen_majority":
        for p in list(model.parameters())[:-1]:
            p.requires_grad_(False)


def orphan_params(model: nn.Module, fault: str | None) -> None:
    """The ``not_landing`` fault, after the optimizer was built: every parameter of ``model`` replaced by a
    copy (``layer.weight = nn.Parameter(layer.weight.detach().clone())``): the model trains the copies'
    gradients, the optimizer steps the tensors the model no longer uses (they have no gradient)."""
    if fault != "not_landing":
        return
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad))


class PullBack:
    """The ``reversed_ema`` fault, called after the step's optimizer steps: from ``onset`` every trainable parameter
    of ``modules`` is pulled toward a copy taken at the onset, ``p.copy_(DECAY * ema_p + (1 - DECAY) * p)`` (an EMA
    update written into the trained model, the EMA copy never updated). Healthy and other faults: nothing."""

    DECAY = 0.99

    def __init__(self, fault: str | None, onset: int, *modules: nn.Module) -> None:
        self.onset = onset
        self.params = [p for m in modules for p in m.parameters() if p.requires_grad] if fault == "reversed_ema" else []
        self.ema: list[torch.Tensor] | None = None

    @torch.no_grad()
    def __call__(self, step: int) -> None:
        if not self.params or step < self.onset:
            return
        if self.ema is None:
            self.ema = [p.detach().clone() for p in self.params]
        for p, e in zip(self.params, self.ema):
            p.copy_(self.DECAY * e + (1 - self.DECAY) * p)


class StaleEval:
    """The ``eval_wrong`` fault: a copy of the model made before training (``copy.deepcopy``), evaluated in its
    place from step 0 (an evaluation model never refreshed). Healthy and other faults: the model itself."""

    def __init__(self, model: nn.Module, fault: str | None, onset: int) -> None:
        import copy

        self.model, self.onset = model, fault_onset(fault, onset)
        self.copy = copy.deepcopy(model) if fault == "eval_wrong" else None

    def at(self, step: int) -> nn.Module:
        """The model the evaluation at ``step`` runs on."""
        return self.copy if self.copy is not None and step >= self.onset else self.model


def bump_lr(opt: torch.optim.Optimizer, factor: float, scheduler: Any = None) -> None:
    """Multiply every group's learning rate (and a scheduler's base rates, which it recomputes from)."""
    for g in opt.param_groups:
        for key in ("lr", "initial_lr", "max_lr", "min_lr"):  # OneCycleLR recomputes from max_lr/min_lr
            if key in g:
                g[key] *= factor
    if scheduler is not None and hasattr(scheduler, "base_lrs"):
        scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]


def wipe_grads(params: Iterable[torch.Tensor]) -> None:
    """The ``wiped_grads`` fault: clipping configured with ``max_norm=0`` zeroes every gradient
    (``clip_grad_norm_`` refuses sparse gradients: those are scaled by 0 the same way)."""
    params = [p for p in params if p.grad is not None]
    torch.nn.utils.clip_grad_norm_([p for p in params if not p.grad.is_sparse], max_norm=0.0)
    for p in params:
        if p.grad.is_sparse:
            p.grad.mul_(0.0)


def shuffle(y: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Targets permuted within the batch: inputs and targets no longer match."""
    return y[torch.randperm(len(y), generator=gen)]


@contextlib.contextmanager
def crash_guard(fault: str | None) -> Iterator[dict[str, str | None]]:
    """Outermost around ``with diag:``: a faulty script that dies is recorded (the session has already
    closed FAILED by then); a healthy run that dies is a bug in the corpus and propagates."""
    box: dict[str, str | None] = {"error": None}
    try:
        yield box
    except Exception as exc:  # noqa: BLE001 - the script's own death, recorded
        if fault is None:
            raise
        box["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"


class Timer:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    @property
    def seconds(self) -> float:
        return round(time.perf_counter() - self.t0, 3)


def mean(xs: list[float]) -> float:
    return float(sum(xs) / max(1, len(xs)))


def batches(x: torch.Tensor, y: torch.Tensor, bsz: int, gen: torch.Generator,
            sort: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled epochs of mini-batches (DataLoader(shuffle=True, drop_last=True)); ``sort`` (the ``sorted_data``
    fault): the samples in label order every epoch, as DataLoader(shuffle=False) over a dataset stored class by class."""
    while True:
        perm = torch.argsort(y, stable=True) if sort else torch.randperm(len(x), generator=gen)
        for i in range(0, len(x) - bsz + 1, bsz):
            idx = perm[i : i + bsz]
            yield x[idx], y[idx]


def restart_loader(loader: Iterator[Any], fault: str | None, onset: int, per_step: int = 1) -> Iterator[Any]:
    """The ``same_batch`` fault around a style's endless ``loader`` (``per_step`` draws a step): its batches until
    ``onset``, then the ``per_step`` batches drawn at ``onset`` again and again, each time a fresh copy, as a
    DataLoader restarted every step collates them anew. ``dup_workers`` (one draw a step): every batch, then a
    fresh copy of it. Any other fault: the loader itself."""
    if fault == "dup_workers" and per_step == 1:
        for batch in loader:
            yield batch
            yield _fresh(batch)
        return
    if fault == "zero_inputs":
        for i, batch in enumerate(loader):
            yield _zeroed(batch) if i >= onset * per_step else batch
        return
    if fault != "same_batch":
        yield from loader
        return
    for _ in range(onset * per_step):
        yield next(loader)
    first = [next(loader) for _ in range(per_step)]
    while True:
        for batch in first:
            yield _fresh(batch)


def _zeroed(batch: Any) -> Any:
    """``batch`` with its model input (the tensor itself, ``batch[0]``, a dict's first input key) zeroed."""
    from trackdiag.util.tensors import INPUT_KEYS

    if isinstance(batch, torch.Tensor):
        return torch.zeros_like(batch)
    if isinstance(batch, dict):
        key = next(k for k in INPUT_KEYS if k in batch)
        return {**batch, key: torch.zeros_like(batch[key])}
    return type(batch)([torch.zeros_like(batch[0]), *batch[1:]])


def _fresh(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_fresh(v) for v in obj)
    return obj


@functools.lru_cache(maxsize=None)
def sk_table(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A scikit-learn bundled table, features standardised on the train split, fixed 80/20 split:
    (xtr, ytr, xva, yva); targets as loaded (class ids as long, regression targets as float)."""
    from sklearn import datasets

    x, y = getattr(datasets, f"load_{name}")(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y)
    y = y.long() if not y.is_floating_point() else y.float()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    tr, va = perm[:cut], perm[cut:]
    mu, sd = x[tr].mean(0), x[tr].std(0).clamp_min(1e-6)
    x = (x - mu) / sd
    return x[tr], y[tr], x[va], y[va]


def play(env: Any, act: Any, rewards: list[float], state: Any) -> float:
    """One episode of a gymnasium ``env`` from ``state`` (pytorch/examples' RL loop): the action ``act(state)``
    picks, each reward appended to ``rewards``; returns the episode's total reward."""
    total = 0.0
    for _ in range(1, 10000):
        state, reward, terminated, truncated, _ = env.step(act(state))
        rewards.append(float(reward))
        total += float(reward)
        if terminated or truncated:
            break
    return total

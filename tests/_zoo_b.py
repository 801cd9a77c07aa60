"""Fault zoo for the second half of the detector catalog: tiny real trainings on sklearn digits,
each with one planted fault (or none). Shared by tests/test_detectors_b.py."""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import trackdiag

_DIGITS: tuple[torch.Tensor, torch.Tensor] | None = None


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as float features in [0, 1] and int64 labels (cached)."""
    global _DIGITS
    if _DIGITS is None:
        x, y = load_digits(return_X_y=True)
        _DIGITS = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y, dtype=torch.long)
    return _DIGITS


def batches(n: int, batch_size: int = 64, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` random batches ``(x, y)`` of digits."""
    x, y = digits()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        idx = torch.randint(0, len(x), (batch_size,), generator=gen)
        yield x[idx], y[idx]


class LogLayer(nn.Module):
    """``log(x)``: -inf where its input is exactly 0 (a saturated sigmoid)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Scale(nn.Module):
    """A learnable per-feature scale (keeps exact zeros of the input exactly zero)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class SafeLog(nn.Module):
    """``where(x > 0, log(x), 0)``: finite forward, but the unselected branch's log(0) = -inf gives
    0 * inf = NaN in the backward (the classic torch.where gradient trap)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.log(x), torch.zeros_like(x))


class Net(nn.Module):
    """``body`` (a Sequential, so modules are named ``body.<i>``) then ``head``."""

    def __init__(self, body: list[nn.Module], width: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(*body)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def leak_net(seed: int = 0) -> nn.Sequential:
    """Linear(64, 4096) -> ReLU -> Linear(4096, 10): a 4 MiB activation per batch of 256."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 4096), nn.ReLU(), nn.Linear(4096, 10))


def log_net(seed: int = 0) -> Net:
    """body.0 Linear, body.1 Sigmoid, body.2 LogLayer (log of the sigmoid), body.3 Linear."""
    torch.manual_seed(seed)
    return Net([nn.Linear(64, 32), nn.Sigmoid(), LogLayer(), nn.Linear(32, 32)])


def where_net(seed: int = 0) -> Net:
    """body.0 Scale, body.1 SafeLog, body.2 Linear, body.3 ReLU: NaN only in the backward of body.1
    (digits have exact-zero pixels)."""
    torch.manual_seed(seed)
    return Net([Scale(64), SafeLog(), nn.Linear(64, 32), nn.ReLU()])


def train(diag: Any, model: nn.Module, opt: torch.optim.Optimizer, data: Any, *,
          plant: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, scaler: Any = None,
          keep: list[Any] | None = None, before_step: Callable[[int, torch.Tensor], None] | None = None) -> int:
    """The standard loop; ``plant(step, x, y)`` may corrupt the batch; ``keep`` collects the output of
    ``model[1]`` WITH its graph every step (the leak: an activation list for "later analysis");
    ``before_step(step, x)`` sees the batch before the update. Returns the steps run."""
    loss_fn = loss_fn or F.cross_entropy
    step = 0
    if keep is not None:
        model[1].register_forward_hook(lambda m, i, out: keep.append(out))  # type: ignore[index]
    with diag:
        for step, (x, y) in enumerate(data):
            if plant is not None:
                x, y = plant(step, x, y)
            if before_step is not None:
                before_step(step, x)
            out = model(x)
            loss = loss_fn(out, y)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            if diag.step(loss, outputs=out, batch=(x, y)):
                break
    return step + 1


def session(model: nn.Module, opt: torch.optim.Optimizer, tmp: Path, level: str = "basic", **kw: Any) -> trackdiag.Diagnostics:
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp), **kw)


def kinds(diag: Any) -> dict[str, list[trackdiag.Alert]]:
    out: dict[str, list[trackdiag.Alert]] = {}
    for a in diag.alerts:
        out.setdefault(a.kind, []).append(a)
    return out


def records(tmp: Path) -> list[dict[str, Any]]:
    """The local record of a closed run, one dict per line."""
    path = next(Path(tmp).rglob("records.jsonl"))
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def slow_loader(n: int, delay: float, first_delay: float | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Digits batches from a generator that sleeps ``delay`` before each (``first_delay`` before the first)."""
    for i, b in enumerate(batches(n, 32)):
        pause = first_delay if i == 0 and first_delay is not None else delay
        if pause:  # no sleep(0): it yields the CPU, which a loaded machine turns into a real wait
            time.sleep(pause)
        yield b

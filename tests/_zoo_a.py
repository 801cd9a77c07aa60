"""Fault zoo for the first half of the detector catalog: small real trainings on sklearn digits.

``train`` is one configurable loop (the nanoGPT order: accumulate -> unscale -> step -> update ->
zero_grad); each fault is planted through its arguments or the model passed in.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread, quiet_probes  # noqa: F401 (the suite's shared loop helpers)


@functools.lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits features in [0, 1], a fixed 80/20 split: (xtr, ytr, xva, yva)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def mlp(depth: int = 2, hidden: int = 64, act: type[nn.Module] = nn.ReLU, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = 64
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), act()]
        width = hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Two convs on the 8x8 digit images."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act2(self.conv2(self.act1(self.conv1(x.view(-1, 1, 8, 8)))))
        return self.head(h.flatten(1))


class TinyTransformer(nn.Module):
    """Each image row is a token (8 tokens of 8 pixels); one encoder layer; mean-pooled head."""

    def __init__(self, d: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(8, d)
        self.pos = nn.Parameter(torch.randn(8, d) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(d, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True,
                                                  activation="gelu")
        self.head = nn.Linear(d, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x.view(-1, 8, 8)) + self.pos)
        return self.head(h.mean(dim=1))


@dataclass
class Result:
    diag: trackdiag.Diagnostics
    losses: list[float]
    val_losses: list[float]

    @property
    def kinds(self) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for a in self.diag.alerts:
            out.setdefault(a.kind, []).append(a)
        return out


def train(model: nn.Module, tmp_path: Any, *, steps: int = 200, lr: float = 1e-3, optimizer: str = "adam",
          batch: int = 64, level: str = "advanced", zero_grad: str = "none", accumulate: int = 1,
          scaler: Any = None, inject_inf_from: int | None = None, eval_every: int = 0,
          train_size: int | None = None, loss_fn: Callable[..., torch.Tensor] = F.cross_entropy,
          params: Any = None, seed: int = 1, weight_decay: float = 0.0, hook: Callable[[str, int], None] | None = None,
          **overrides: Any) -> Result:
    """Train ``model`` on digits under a fresh ``Diagnostics``. ``zero_grad``: ``none`` (set_to_none),
    ``zeros`` (set_to_none=False), ``skip`` (the fault), ``before_backward`` (zeroed after the forward).
    ``hook(where, step)`` is called with ``before_step``/``after_step`` around the optimizer step."""
    xtr, ytr, xva, yva = digits()
    if train_size is not None:
        xtr, ytr = xtr[:train_size], ytr[:train_size]
    params = list(model.parameters()) if params is None else params
    opt_cls = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD}[optimizer]
    opt = opt_cls(params, lr=lr, weight_decay=weight_decay)
    overrides.setdefault("sinks", ["local"])
    diag = trackdiag.Diagnostics(model, opt, scaler, level=level, output_dir=str(tmp_path), **overrides)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    val_losses: list[float] = []
    with one_thread():
        _loop(model, diag, opt, params, xtr, ytr, xva, yva, gen, losses, val_losses, steps=steps, batch=batch,
              zero_grad=zero_grad, accumulate=accumulate, scaler=scaler, inject_inf_from=inject_inf_from,
              eval_every=eval_every, loss_fn=loss_fn, hook=hook or (lambda where, step: None))
    return Result(diag, losses, val_losses)


def _loop(model: nn.Module, diag: trackdiag.Diagnostics, opt: torch.optim.Optimizer, params: list[torch.Tensor],
          xtr: torch.Tensor, ytr: torch.Tensor, xva: torch.Tensor, yva: torch.Tensor, gen: torch.Generator,
          losses: list[float], val_losses: list[float], *, steps: int, batch: int, zero_grad: str, accumulate: int,
          scaler: Any, inject_inf_from: int | None, eval_every: int, loss_fn: Callable[..., torch.Tensor],
          hook: Callable[[str, int], None]) -> None:
    with diag:
        for step in range(steps):
            for _ in range(accumulate):
                idx = torch.randint(0, len(xtr), (min(batch, len(xtr)),), generator=gen)
                out = model(xtr[idx])
                loss = loss_fn(out, ytr[idx])
                if zero_grad == "before_backward":
                    opt.zero_grad(set_to_none=True)
                (scaler.scale(loss / accumulate) if scaler is not None else loss / accumulate).backward()
            if inject_inf_from is not None and step >= inject_inf_from:
                grad = next(p.grad for p in params if p.grad is not None)
                grad.view(-1)[0] = float("inf")
            hook("before_step", step)
            if scaler is not None:
                scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            hook("after_step", step)
            if zero_grad in ("none", "zeros"):
                opt.zero_grad(set_to_none=zero_grad == "none")
            losses.append(float(loss.detach()))
            diag.step(loss.detach(), outputs=out, batch=(xtr[idx], ytr[idx]))
            if eval_every and (step + 1) % eval_every == 0:
                model.eval()
                with torch.no_grad():
                    val = float(loss_fn(model(xva), yva))
                model.train()
                val_losses.append(val)
                diag.log_eval(loss=val)


def records(path: Any) -> list[dict[str, Any]]:
    """The local record of a finished run, one dict per logging step."""
    import json
    from pathlib import Path

    return [json.loads(line) for line in (Path(path) / "records.jsonl").read_text().splitlines() if line]


def series(path: Any, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of a scalar key over the records of a run."""
    return [(r["step"], float(r["scalars"][key])) for r in records(path) if key in r["scalars"]]


def manual_loop(tmp_path: Any, pattern: str, steps: int = 12, **overrides: Any) -> trackdiag.Diagnostics:
    """A hand-written loop for zero_grad patterns: ``gan`` (another loss backpropagates into the model
    after its step, before it is zeroed), ``lbfgs`` (closure optimizer), ``every2`` (zeroed every 2 steps)."""
    xtr, ytr, _, _ = digits()
    model = mlp()
    opt: Any = (torch.optim.LBFGS(model.parameters(), max_iter=1) if pattern == "lbfgs"
                else torch.optim.Adam(model.parameters(), 1e-3))
    x, y = xtr[:64], ytr[:64]
    overrides.setdefault("probes", quiet_probes())
    with one_thread(), trackdiag.Diagnostics(model, opt, sinks=["local"], output_dir=str(tmp_path), every=2,
                                             **overrides) as diag:
        for step in range(steps):
            if pattern == "lbfgs":
                def closure() -> torch.Tensor:
                    opt.zero_grad()
                    out = F.cross_entropy(model(x), y)
                    out.backward()
                    return out
                loss: torch.Tensor = opt.step(closure)
            else:
                if pattern == "gan" or (pattern == "every2" and step % 2 == 0):
                    opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                if pattern == "gan":  # another loss backpropagates into the model before it is zeroed
                    model(x).pow(2).mean().backward()
            diag.step(loss.detach())
    return diag


def gan(tmp_path: Any, steps: int = 150) -> trackdiag.Diagnostics:
    """A tiny GAN on digits: two components, the D step zeroes D only, and G's loss backpropagates
    through D after D's step (before D is zeroed again): a legit pattern ``grads_not_zeroed`` must allow."""
    xtr, *_ = digits()
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Sigmoid())
    d = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    og = torch.optim.Adam(g.parameters(), 2e-4, betas=(0.5, 0.999))
    od = torch.optim.Adam(d.parameters(), 2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(64, 1), torch.zeros(64, 1)
    with one_thread(), trackdiag.Diagnostics({"G": g, "D": d}, {"G": og, "D": od}, sinks=["local"],
                                             output_dir=str(tmp_path), probes=quiet_probes()) as diag:
        for _ in range(steps):
            x = xtr[torch.randint(0, len(xtr), (64,))]
            od.zero_grad()
            fake = g(torch.randn(64, 16))
            d_loss = bce(d(x), ones) + bce(d(fake.detach()), zeros)
            d_loss.backward()
            od.step()
            og.zero_grad()
            g_loss = bce(d(fake), ones)
            g_loss.backward()
            og.step()
            diag.step({"G": g_loss.detach(), "D": d_loss.detach()}, outputs={"G": fake, "D": d(x)})
    return diag

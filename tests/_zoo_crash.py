"""Loops in the styles users write, for the flight recorder (a script that dies mid-step), the NaN
culprit a replay cannot reproduce, sparse gradients and the user's own loss computation.

Scripts (each small: 1 thread, tens of steps, a second or two):
  ``vae``        a VAE on digits; ``binary_cross_entropy`` raises when the decoder's output is NaN;
  ``rl``         REINFORCE on a contextual bandit; ``Categorical(probs=...)`` raises on NaN probabilities;
  ``mlp``        a digits classifier (``nn.Sequential``); ``gru`` a character GRU language model;
  ``dotforward`` an MLP whose layers are called as ``layer.forward(x)`` (hooks never run);
  ``cellloop``   a ``GRUCell`` driven step by step through ``cell.forward`` by the loop;
  ``recsys``     a recommender: ``EmbeddingBag(sparse=True)`` with index/offset tensors + dense features,
                 ``SparseAdam`` (+ Adam for the dense part) or plain SGD;
  ``ddpm``       a denoising diffusion model whose ``forward(x0)`` returns its own loss;
  ``twotower``   a model taking two inputs (user and item features) scored against a click label;
  ``seq2seq``    the PyTorch tutorial's per-example GRU encoder/decoder with two optimizers.
Faults: ``NanGate`` (NaN from ``onset`` on: a buffer flag, so a replay reproduces it),
``TransientGate`` (NaN in exactly one real forward: a replay never sees it).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread  # noqa: F401 (re-exported for the zoo's styles)
from _zoo_b import digits

LEAN = {"report": {"enabled": False}}


class NanGate(nn.Module):
    """``inner``'s output, NaN once the ``fault`` buffer is 1 (``0 * log(0)``); with ``backward=True``
    the forward stays finite and the backward makes the NaN instead (``x + sqrt(0 * x)``: the
    gradient of sqrt at 0 is infinite, times 0 is NaN)."""

    def __init__(self, inner: nn.Module, backward: bool = False) -> None:
        super().__init__()
        self.inner, self.backward = inner, backward
        self.register_buffer("fault", torch.zeros(()), persistent=False)

    def forward(self, *args: Any) -> Any:
        out = self.inner(*args)
        first = out[0] if isinstance(out, tuple) else out
        if self.backward:
            if bool(self.fault):  # the user's model reads its own flag
                first = first + torch.sqrt(first * 0)
        else:
            first = first + torch.log(1 - self.fault) * 0  # log(1) * 0 = 0 when off; log(0) * 0 = NaN when on
        return (first, *out[1:]) if isinstance(out, tuple) else first


class TransientGate(nn.Module):
    """``inner``'s output, NaN in the first training forward of step ``at`` only (the loop sets
    ``now``): a glitch that a replay of that step (or the pre-flight's copy) never sees again."""

    def __init__(self, inner: nn.Module, at: int = -1) -> None:
        super().__init__()
        self.inner, self.at, self.now, self.fired = inner, at, -1, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training and self.now == self.at and not self.fired:
            self.fired = True
            out = out * torch.nan
        return out


def session(model: Any, opt: Any, out: Any, level: str, every: int = 5, **kw: Any) -> trackdiag.Diagnostics:
    probes = {**LEAN, **kw.pop("probes", {})}
    if kw.get("loss_fn", 0) is None:
        kw.pop("loss_fn")  # not given: the session's default
    return trackdiag.Diagnostics(model, opt, level=level, every=every, sinks=kw.pop("sinks", ["local"]),
                                 output_dir=str(out), probes=probes, **kw)


# ------------------------------------------------------------------------------------------ VAE
class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16))
        self.dec = nn.Sequential(nn.Linear(8, 48), nn.ReLU(), NanGate(nn.Linear(48, 64)), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


def vae(level: str, out: Any, onset: int | None = None, steps: int = 30, use_with: bool = True, lr: float = 1e-3,
        lr_jump_at: int | None = None, **kw: Any) -> trackdiag.Diagnostics:
    """The VAE example's loop; from ``onset`` its decoder's ``dec.2`` outputs NaN and BCE raises. ``lr_jump_at``:
    the loop multiplies the LR by 1000 at that step instead (at ``lr=1e-2`` the next forward's ``exp(0.5 * logvar)``
    overflows and BCE raises)."""
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr)
    diag = session(model, opt, out, level, **kw)
    x_all = digits()[0]
    with one_thread(), (diag if use_with else contextlib.nullcontext()):
        for step in range(steps):
            x = x_all[step * 32 % 1500:][:32]
            model.dec[2].fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            for g in opt.param_groups if step == lr_jump_at else ():
                g["lr"] *= 1000
            recon, mu, logvar = model(x)
            bce = F.binary_cross_entropy(recon, x, reduction="sum") / len(x)
            kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
            loss = bce + kld
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=x)
    return diag


# ------------------------------------------------------------------------------------------ RL
class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), NanGate(nn.Linear(32, 32)), nn.Tanh())
        self.head = nn.Linear(32, 3)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.head(self.body(obs)), dim=-1)


def rl(level: str, out: Any, onset: int | None = None, steps: int = 30, raise_at: int | None = None,
       use_with: bool = True, **kw: Any) -> trackdiag.Diagnostics:
    """REINFORCE with a running-mean baseline on a 3-armed contextual bandit (the best arm is the
    argmax of the first 3 features); from ``onset`` the policy's ``body.2`` outputs NaN and
    ``Categorical`` raises. ``raise_at``: an unrelated RuntimeError at that step instead."""
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), 1e-2)
    diag = session(policy, opt, out, level, **kw)
    gen = torch.Generator().manual_seed(3)
    baseline = 0.0
    with one_thread(), (diag if use_with else contextlib.nullcontext()):
        for step in range(steps):
            obs = torch.randn(64, 4, generator=gen)
            policy.body[2].fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            dist = torch.distributions.Categorical(probs=policy(obs))
            action = dist.sample()
            if step == raise_at:
                raise RuntimeError(f"environment server disconnected at step {step}")
            reward = (action == obs[:, :3].argmax(1)).float()
            loss = -(dist.log_prob(action) * (reward - baseline)).mean()
            baseline = 0.9 * baseline + 0.1 * float(reward.mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=obs)
    return diag


# ------------------------------------------------------------------------------------------ classifiers
def mlp_model(gate: nn.Module | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), gate or nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def mlp(level: str, out: Any, transient_at: int | None = None, steps: int = 30, **kw: Any) -> trackdiag.Diagnostics:
    """A digits classifier; with ``transient_at`` its ``2`` layer outputs NaN in that step's forward only."""
    model = mlp_model(TransientGate(nn.Linear(32, 32), -1 if transient_at is None else transient_at))
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    diag = session(model, opt, out, level, **kw)
    x_all, y_all = digits()
    with one_thread(), diag:
        for step in range(steps):
            model[2].now = step
            x, y = x_all[step * 64 % 1700:][:64], y_all[step * 64 % 1700:][:64]
            out_ = model(x)
            loss = F.cross_entropy(out_, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out_, batch=(x, y))
    return diag


class CharGRU(nn.Module):
    def __init__(self, vocab: int = 27, gate: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 16)
        self.gru = nn.GRU(16, 32, batch_first=True)
        self.proj = TransientGate(nn.Linear(32, 32)) if gate else nn.Linear(32, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(idx))
        return self.head(torch.tanh(self.proj(h)))


def gru(level: str, out: Any, transient_at: int | None = None, steps: int = 30, **kw: Any) -> trackdiag.Diagnostics:
    """A character GRU language model on random "names"; ``proj`` NaN in one forward (``transient_at``)."""
    torch.manual_seed(0)
    model = CharGRU()
    model.proj.at = -1 if transient_at is None else transient_at
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    diag = session(model, opt, out, level, **kw)
    gen = torch.Generator().manual_seed(1)
    with one_thread(), diag:
        for step in range(steps):
            model.proj.now = step
            seq = torch.randint(1, 27, (16, 12), generator=gen)
            x, y = seq[:, :-1], seq[:, 1:]
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, 27), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
    return diag


class DotForward(nn.Module):
    """Layers called as ``layer.forward(x)``: their forward hooks never run."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(64, 32), NanGate(nn.Linear(32, 32)), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp.forward(x))
        h = torch.relu(self.mid.forward(h))
        return self.out.forward(h)


def dotforward(level: str, out: Any, onset: int | None = None, steps: int = 30, **kw: Any) -> trackdiag.Diagnostics:
    torch.manual_seed(0)
    model = DotForward()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, out, level, **kw)
    x_all, y_all = digits()
    with one_thread(), diag:
        for step in range(steps):
            model.mid.fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            x, y = x_all[step * 64 % 1700:][:64], y_all[step * 64 % 1700:][:64]
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=logits, batch=(x, y))
    return diag


class CellModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(8, 24)
        self.mix = NanGate(nn.Linear(24, 24))
        self.head = nn.Linear(24, 1)


def cell_step(model: CellModel, seq: torch.Tensor) -> torch.Tensor:
    """The loop's forward and loss for one batch (also the ``loss_fn`` a user would hand over)."""
    h = torch.zeros(seq.shape[0], 24)
    for t in range(seq.shape[1]):
        h = torch.tanh(model.mix.forward(model.cell.forward(seq[:, t], h)))
    return F.mse_loss(model.head.forward(h).squeeze(1), seq[:, :, 0].mean(1))


def cellloop(level: str, out: Any, onset: int | None = None, steps: int = 30, user_loss: bool = False,
             **kw: Any) -> trackdiag.Diagnostics:
    """A recurrent regressor driven step by step by the loop through ``.forward`` (no root forward);
    ``user_loss``: the session gets ``loss_fn=lambda seq: cell_step(model, seq)``."""
    torch.manual_seed(0)
    model = CellModel()
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    diag = session(model, opt, out, level, loss_fn=(lambda seq: cell_step(model, seq)) if user_loss else None, **kw)
    gen = torch.Generator().manual_seed(2)
    with one_thread(), diag:
        for step in range(steps):
            model.mix.fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            seq = torch.randn(16, 6, 8, generator=gen)
            loss = cell_step(model, seq)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=seq)
    return diag


def run_quietly(fn: Callable[..., Any], *args: Any, **kw: Any) -> tuple[Any, BaseException | None]:
    """``fn(*args, **kw)`` -> (its result or None, the exception it raised or None)."""
    try:
        return fn(*args, **kw), None
    except Exception as exc:  # noqa: BLE001 - the tests look at it
        return None, exc

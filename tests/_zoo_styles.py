"""More real code: loops whose batch is not ``(inputs, targets)`` for ``model(batch[0])``.

  ``recsys``   a recommender: ``EmbeddingBag(sparse=True)`` over index/offset tensors plus dense
               features, clicks as targets; ``SparseAdam`` for the bag + ``Adam`` for the rest, or one
               plain ``SGD`` for all (sparse gradients either way);
  ``ddpm``     a denoising diffusion model whose ``forward(x0)`` samples a time step and noise and
               returns its own loss (the diffusion-library style);
  ``twotower`` a model with two inputs (user and item features), scored against a click label;
  ``seq2seq``  the PyTorch tutorial's per-example GRU encoder/decoder: the loop drives the encoder
               token by token and the decoder step by step, two optimizers.
Each takes ``loss_fn=True`` to hand trackdiag the loop's loss computation (``Diagnostics(...,
loss_fn=...)``) and ``onset`` to make a named module output NaN from that step on.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_crash import NanGate, one_thread, session


# ------------------------------------------------------------------------------------------ recommender
class Recommender(nn.Module):
    def __init__(self, items: int = 500, dim: int = 16, backward: bool = False) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(items, dim, mode="mean", sparse=True)
        self.dense = nn.Linear(8, dim)
        self.tower = nn.Sequential(nn.Linear(2 * dim, 32), nn.ReLU(), NanGate(nn.Linear(32, 16), backward), nn.ReLU(),
                                   nn.Linear(16, 1))

    def forward(self, dense: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.tower(torch.cat([self.bag(index, offsets), torch.relu(self.dense(dense))], 1)).squeeze(1)


def recsys_batch(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dense features, item indices, offsets, clicks): ragged bags of 1-6 items; a click when the
    dense features say so or the bag holds a popular item (index < 50)."""
    sizes = torch.randint(1, 7, (n,), generator=gen)
    index = torch.randint(0, 500, (int(sizes.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)[:-1]])
    dense = torch.randn(n, 8, generator=gen)
    popular = torch.zeros(n).index_add_(0, torch.repeat_interleave(torch.arange(n), sizes), (index < 50).float())
    return dense, index, offsets, ((dense[:, 0] > 0) | (popular > 0)).float()


def recsys(level: str, out: Any, optim: str = "sparseadam", onset: int | None = None, steps: int = 25,
           loss_fn: bool = False, backward: bool = False, **kw: Any) -> trackdiag.Diagnostics:
    """``backward``: the planted fault makes NaN in the backward of ``tower.2`` (forward finite)."""
    torch.manual_seed(0)
    model = Recommender(backward=backward)
    if optim == "sparseadam":
        opts: Any = [torch.optim.SparseAdam(list(model.bag.parameters()), lr=1e-2),
                     torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("bag.")], lr=1e-3)]
    else:
        opts = torch.optim.SGD(model.parameters(), lr=0.05)

    def compute(batch: Any) -> torch.Tensor:
        dense, index, offsets, clicks = batch
        return F.binary_cross_entropy_with_logits(model(dense, index, offsets), clicks)

    diag = session(model, opts, out, level, loss_fn=compute if loss_fn else None, **kw)
    gen = torch.Generator().manual_seed(1)
    with one_thread(), diag:
        for step in range(steps):
            model.tower[2].fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            batch = recsys_batch(gen)
            loss = compute(batch)
            for o in (opts if isinstance(opts, list) else [opts]):
                o.zero_grad()
            loss.backward()
            for o in (opts if isinstance(opts, list) else [opts]):
                o.step()
            diag.step(loss, batch=batch)
    return diag


# ------------------------------------------------------------------------------------------ diffusion
class Denoiser(nn.Module):
    """A DDPM on 2-D points: ``forward(x0)`` noises a batch at random time steps and returns the MSE
    between the true and the predicted noise (the model computes its own loss)."""

    def __init__(self, steps: int = 50) -> None:
        super().__init__()
        betas = torch.linspace(1e-4, 0.05, steps)
        self.register_buffer("alpha_bar", torch.cumprod(1 - betas, 0))
        self.t_embed = nn.Embedding(steps, 32)
        self.net = nn.Sequential(nn.Linear(2, 32), nn.SiLU(), NanGate(nn.Linear(32, 32)), nn.SiLU(), nn.Linear(32, 2))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, len(self.alpha_bar), (x0.shape[0],), device=x0.device)
        noise = torch.randn_like(x0)
        a = self.alpha_bar[t].unsqueeze(1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        h = self.net[0](xt) + self.t_embed(t)
        for layer in self.net[1:]:
            h = layer(h)
        return F.mse_loss(h, noise)


def ddpm(level: str, out: Any, onset: int | None = None, steps: int = 25, loss_fn: bool = False,
         **kw: Any) -> trackdiag.Diagnostics:
    torch.manual_seed(0)
    model = Denoiser()
    opt = torch.optim.AdamW(model.parameters(), 2e-3)
    diag = session(model, opt, out, level, loss_fn=model if loss_fn else None, **kw)
    gen = torch.Generator().manual_seed(2)
    with one_thread(), diag:
        for step in range(steps):
            model.net[2].fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            angle = torch.rand(128, generator=gen) * 6.283
            x0 = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(128, 2, generator=gen)  # a ring
            loss = model(x0)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=x0)
    return diag


# ------------------------------------------------------------------------------------------ two inputs
class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.user = nn.Sequential(nn.Linear(10, 24), nn.ReLU(), nn.Linear(24, 16))
        self.item = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), NanGate(nn.Linear(24, 16)))

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        return (self.user(user) * self.item(item)).sum(1)


def twotower(level: str, out: Any, onset: int | None = None, steps: int = 25, loss_fn: bool = False,
             **kw: Any) -> trackdiag.Diagnostics:
    torch.manual_seed(0)
    model = TwoTower()
    opt = torch.optim.Adam(model.parameters(), 3e-3)

    def compute(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(batch["user"], batch["item"]), batch["click"])

    diag = session(model, opt, out, level, loss_fn=compute if loss_fn else None, **kw)
    gen = torch.Generator().manual_seed(3)
    with one_thread(), diag:
        for step in range(steps):
            model.item[2].fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            user, item = torch.randn(64, 10, generator=gen), torch.randn(64, 6, generator=gen)
            batch = {"user": user, "item": item, "click": ((user[:, 0] * item[:, 0]) > 0).float()}
            loss = compute(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=batch)
    return diag


# ------------------------------------------------------------------------------------------ seq2seq
class Encoder(nn.Module):
    def __init__(self, vocab: int = 12, hidden: int = 32) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden)

    def forward(self, token: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gru(self.embedding(token).view(1, 1, -1), hidden)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 12, hidden: int = 32) -> None:
        super().__init__()
        self.embedding, self.gru = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden)
        self.out = NanGate(nn.Linear(hidden, vocab))

    def forward(self, token: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output, hidden = self.gru(F.relu(self.embedding(token).view(1, 1, -1)), hidden)
        return F.log_softmax(self.out(output[0]), dim=1), hidden


def seq2seq_loss(enc: Encoder, dec: Decoder, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The tutorial's train(): the encoder token by token, the decoder with teacher forcing."""
    src, tgt = pair
    hidden = torch.zeros(1, 1, 32)
    for tok in src:
        _, hidden = enc(tok.view(1), hidden)
    token, loss = torch.zeros(1, dtype=torch.long), torch.zeros(())
    for tok in tgt:
        out, hidden = dec(token, hidden)
        loss = loss + F.nll_loss(out, tok.view(1))
        token = tok.view(1)
    return loss / len(tgt)


def seq2seq(level: str, out: Any, onset: int | None = None, steps: int = 25, loss_fn: bool = False,
            **kw: Any) -> trackdiag.Diagnostics:
    """Reversal of random digit strings (tokens 2-11), one pair per step."""
    torch.manual_seed(0)
    enc, dec = Encoder(), Decoder()
    enc_opt, dec_opt = torch.optim.SGD(enc.parameters(), 0.05), torch.optim.SGD(dec.parameters(), 0.05)
    diag = session({"encoder": enc, "decoder": dec}, {"encoder": enc_opt, "decoder": dec_opt}, out, level,
                   loss_fn=(lambda pair: seq2seq_loss(enc, dec, pair)) if loss_fn else None, **kw)
    gen = torch.Generator().manual_seed(4)
    with one_thread(), diag:
        for step in range(steps):
            dec.out.fault.fill_(1.0 if onset is not None and step >= onset else 0.0)
            src = torch.randint(2, 12, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen)
            pair = (src, src.flip(0))
            enc_opt.zero_grad()
            dec_opt.zero_grad()
            loss = seq2seq_loss(enc, dec, pair)
            loss.backward()
            enc_opt.step()
            dec_opt.step()
            diag.step(loss, batch=pair)
    return diag

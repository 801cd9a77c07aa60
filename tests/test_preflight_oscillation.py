"""The pre-flight's one-batch fit read at the median loss of its last steps, not the last one alone.

SGDR's recipe (SGD, Nesterov momentum 0.9, lr 0.05 from step 0, ``CosineAnnealingWarmRestarts``) on a small
CNN: the pre-flight's 30 full-batch steps on one batch oscillate as high-rate momentum does (0.97, 0.90, 0.83,
0.74, 0.67, 0.89, 3.07 at steps 24-30, 0.46 at step 39: the batch is fitted), and the 30th step landed on the
spike: "the model cannot fit one batch" (warning) on a healthy run. A loss that does not fall at all still fails the check
(``test_a_loss_that_cannot_fall_still_fails``)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import trackdiag

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


def _data(n: int, gen: torch.Generator, protos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 4, (n,), generator=gen)
    shift = torch.randint(-1, 2, (n, 2), generator=gen)
    x = torch.stack([torch.roll(protos[c], (int(a), int(b)), (1, 2)) for c, (a, b) in zip(y.tolist(), shift)])
    x = x + 0.8 * torch.randn(x.shape, generator=gen)
    flip = torch.rand(n, generator=gen) < 0.05  # 5 % label noise
    return x, torch.where(flip, torch.randint(0, 4, (n,), generator=gen), y)


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(16 * 9, 32), nn.ReLU(), nn.Linear(32, 4))


def _sgdr(tmp_path, seed: int, loss_fn=None) -> list[trackdiag.Alert]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 11)
    protos = (torch.rand(4, 1, 12, 12, generator=gen) > 0.6).float()
    x_all, y_all = _data(3000, gen, protos)
    _data(800, gen, protos)  # the script's test set: the same draws as the loop that raised it
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=50, T_mult=1, eta_min=1e-4)
    with torch.random.fork_rng():
        torch.set_num_threads(1)
        with trackdiag.Diagnostics(model, opt, level="extreme", sinks=["local"], output_dir=str(tmp_path),
                                   probes=OFF, loss_fn=loss_fn(model) if loss_fn else None) as diag:
            perm = torch.randperm(len(x_all), generator=gen)
            for step in range(3):
                idx = perm[step * 32:(step + 1) * 32]
                x, y = x_all[idx], y_all[idx]
                out = model(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                diag.step(loss, outputs=out, batch=(x, y))
    return [a for a in diag.alerts if a.kind == "preflight"]


def test_an_oscillating_one_batch_fit_passes(tmp_path) -> None:
    threads = torch.get_num_threads()
    try:
        found = _sgdr(tmp_path, seed=1)
    finally:
        torch.set_num_threads(threads)
    assert [(a.where, a.severity) for a in found if a.severity != "info"] == [], [a.message for a in found]


def test_a_loss_that_cannot_fall_still_fails(tmp_path) -> None:
    """The same loop whose loss (the session's ``loss_fn``, what the pre-flight fits) draws fresh labels
    at every call: nothing to fit, the check fails, named at step 0."""
    def loss_fn(model: nn.Module):
        def loss(batch):
            x, y = batch
            return F.cross_entropy(model(x), torch.randint(0, 4, y.shape))
        return loss

    threads = torch.get_num_threads()
    try:
        found = _sgdr(tmp_path, seed=1, loss_fn=loss_fn)
    finally:
        torch.set_num_threads(threads)
    assert any(a.where == "overfit" and a.severity == "warning" and a.step == 0 for a in found), \
        [(a.where, a.severity, a.message) for a in found]

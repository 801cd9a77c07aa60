"""A forward that draws from a ``torch.Generator`` the loop passes to it (scheduled sampling's coin flips,
``torch.rand(..., generator=gen)``): trackdiag's own forwards with the step's arguments (the pre-flight's
one-batch fit at ``extreme``, the NaN replay) used to advance that generator, so the run drew other coin
flips than it would have without trackdiag (its losses differed from step 1 at ``extreme`` only). Now the
generator is as the loop left it, and the run's losses are those of the loop without trackdiag."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import one_thread
from trackdiag.capture.isolation import generators_in, generators_kept

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


class Sampled(nn.Module):
    """An MLP that replaces half of its hidden units by their mean where a coin drawn from ``gen`` says so."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        coin = torch.rand(x.shape[0], 1, generator=gen) < 0.5
        return self.out(torch.where(coin, h.mean(0, keepdim=True).expand_as(h), h))


def _losses(level: str | None, tmp_path) -> list[float]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    data = torch.Generator().manual_seed(3)
    model = Sampled()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                 probes=OFF) if level else None
    losses = []
    with one_thread():
        for _ in range(12):
            x = torch.randn(32, 8, generator=data)
            y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
            out = model(x, gen)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if diag is not None:
                diag.step(loss, outputs=out, batch=(x, y))
            losses.append(float(loss))
        if diag is not None:
            diag.close()
    return losses


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_the_users_generator_draws_what_it_would_without_trackdiag(tmp_path, level) -> None:
    assert _losses(level, tmp_path / level) == _losses(None, tmp_path / "bare")


def test_generators_are_found_in_the_arguments_and_put_back() -> None:
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    found = generators_in((torch.ones(1), g1), {"sampling": [g2, g1]})
    assert [id(g) for g in found] == [id(g1), id(g2)]
    before = [g.get_state() for g in found]
    with generators_kept(found):
        torch.rand(5, generator=g1), torch.rand(5, generator=g2)
    assert all(torch.equal(g.get_state(), b) for g, b in zip(found, before))

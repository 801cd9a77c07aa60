"""The zero-grad check on loops whose gradients it used to misread (issue 44's rehearsal, round 2):

- a critic trained in a phase of its own, ``requires_grad`` turned off for the generator's step and on again for its
  own (igul222's WGAN-GP, junyanz's CycleGAN ``set_requires_grad``): the session meets it frozen at every ``step()``,
  and its gradients were never hooked, so a ``zero_grad`` it missed went unseen;
- a loss that compares the model's outputs with each other (a WGAN critic's mean difference, a distance between two
  embeddings): the output layer's bias gets no gradient at all, and with it as the one parameter the check reads, every
  pass looked like one into freshly zeroed gradients.

Each fault is planted at step ``ONSET`` and must be raised as ``grads_not_zeroed`` naming its component within a step;
the same loops with their ``zero_grad`` raise nothing of warning or worse."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import trackdiag
from trackdiag.capture.tap_hooks import pick_sentinel, watched

ONSET, STEPS = 60, 90


def _loud(diag: trackdiag.Diagnostics) -> list[tuple[str, int, str]]:
    return [(a.kind, a.step, a.where) for a in diag.alerts if a.severity != "info"]


def wgan(out: Path, *, toggle: bool, zero_d: bool) -> trackdiag.Diagnostics:
    """A WGAN critic and generator on a 2-D Gaussian, two critic steps per generator step (its loss: the difference of
    the critic's means), ``requires_grad`` of the critic toggled around the generator's step when ``toggle``."""
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
    d = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
    opt_g = torch.optim.Adam(g.parameters(), 1e-3, betas=(0.5, 0.9))
    opt_d = torch.optim.Adam(d.parameters(), 1e-3, betas=(0.5, 0.9))
    diag = trackdiag.Diagnostics({"G": g, "D": d}, {"G": opt_g, "D": opt_d}, level="advanced", sinks=["local"],
                                 output_dir=str(out), probes={"report": {"enabled": False}})
    with diag:
        for it in range(STEPS):
            d.requires_grad_(True)
            for _ in range(2):
                real = torch.randn(64, 2) * 0.3 + 2
                fake = g(torch.randn(64, 4)).detach()
                if zero_d or it < ONSET:
                    opt_d.zero_grad()
                d_loss = d(fake).mean() - d(real).mean()
                d_loss.backward()
                opt_d.step()
            if toggle:
                d.requires_grad_(False)
            opt_g.zero_grad()
            fake = g(torch.randn(64, 4))
            g_loss = -d(fake).mean()
            g_loss.backward()
            opt_g.step()
            diag.step({"G": g_loss, "D": d_loss}, outputs={"G": fake}, batch=real)
    return diag


def siamese(out: Path, *, zero: bool) -> trackdiag.Diagnostics:
    """Pairs embedded by one network and pulled together or pushed apart by their distance (a contrastive loss):
    the embedding layer's bias cancels in every distance."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    centres = torch.randn(4, 8) * 2
    diag = trackdiag.Diagnostics(net, opt, level="advanced", sinks=["local"], output_dir=str(out),
                                 probes={"report": {"enabled": False}})
    with diag:
        for step in range(STEPS):
            ca, cb = torch.randint(0, 4, (64,)), torch.randint(0, 4, (64,))
            a, b = centres[ca] + torch.randn(64, 8) * 0.5, centres[cb] + torch.randn(64, 8) * 0.5
            same = (ca == cb).float()
            dist = (net(a) - net(b)).pow(2).sum(1).add(1e-9).sqrt()
            loss = (same * dist.pow(2) + (1 - same) * (2.0 - dist).clamp(min=0).pow(2)).mean()
            if zero or step < ONSET:
                opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, batch=(a, b))
    return diag


@pytest.mark.parametrize("toggle", [True, False], ids=["critic-frozen-for-the-generator", "never-frozen"])
def test_a_critic_zero_grad_left_out_is_raised(tmp_path: Path, toggle: bool) -> None:
    diag = wgan(tmp_path, toggle=toggle, zero_d=False)
    first = next(((k, s, w) for k, s, w in _loud(diag) if k == "grads_not_zeroed"), None)
    assert first is not None and first[2] == "D" and ONSET <= first[1] <= ONSET + 1, _loud(diag)


def test_a_critic_frozen_for_the_generator_step_is_quiet(tmp_path: Path) -> None:
    diag = wgan(tmp_path, toggle=True, zero_d=True)
    assert _loud(diag) == []
    assert diag.summary()["disabled_probes"] == {}


def test_embeddings_compared_by_distance(tmp_path: Path) -> None:
    healthy = siamese(tmp_path / "healthy", zero=True)
    assert _loud(healthy) == []
    faulty = siamese(tmp_path / "faulty", zero=False)
    first = next(((k, s) for k, s, _ in _loud(faulty) if k == "grads_not_zeroed"), None)
    assert first is not None and ONSET <= first[1] <= ONSET + 1, _loud(faulty)


def test_the_sentinel_is_not_the_output_bias_and_a_phased_component_is_watched(tmp_path: Path) -> None:
    d = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(d.parameters())
    diag = trackdiag.Diagnostics(d, opt, level="basic", sinks=["local"], output_dir=str(tmp_path))
    comp = diag.components[0]
    assert pick_sentinel(comp) is not d[2].bias
    assert pick_sentinel(comp) in (d[0].bias, d[2].weight)  # the smallest of what is left at the two ends
    d.requires_grad_(False)
    assert len(watched(comp)) == 4  # frozen now, in an optimizer: watched all the same
    diag.close()


def test_a_sentinel_replaced_mid_step_gives_no_verdict(tmp_path: Path) -> None:
    """The first layer cut off by a ``.detach()`` (the sentinel is there: no pass reaches it) under gradient
    accumulation: after three passes the tap follows a parameter the passes reach, in the middle of a step whose
    earlier micro-batches have already accumulated into it. That pass is not one into stale gradients (the corpus's
    amp_bf16 style with its first layers detached got a ``grads_not_zeroed`` info at step 1 from it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    diag = trackdiag.Diagnostics(net, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}})
    with diag:
        for _ in range(70):  # the detached layers are said after 50 steps without a gradient
            opt.zero_grad()
            for _ in range(4):  # micro-batches
                x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
                out = net[2:](net[:2](x).detach())
                loss = nn.functional.cross_entropy(out, y) / 4
                loss.backward()
            opt.step()
            diag.step(loss * 4, outputs=out, batch=(x, y))
    assert not [a for a in diag.alerts if a.kind in ("grads_not_zeroed", "accumulation_reset")], diag.alerts
    assert "stale_params" in [a.kind for a in diag.alerts if a.severity != "info"]  # the cut is still said (random
    # labels: not_learning too)

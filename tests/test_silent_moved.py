"""Issue 45, item 4's second half: weights that move between two steps of the watched optimizer (``weights_moved``,
``trackdiag/probes/moved.py`` + ``trackdiag/rules/moved.py``).

The planted fault of the corpus (``reversed_ema``: an EMA update written into the trained model, pulling it toward a
copy taken at the onset) is caught in two styles exactly as ``benchmarks/styles_report.py`` judges it; the measured
movement is checked against the same quantity computed from full copies of the weights in float64; loops that move
their weights legitimately between steps stay silent: WGAN weight clipping, SAM's perturb-and-restore, a correct
EMA into a separate model (a submodule of the watched one, whose tensors the optimizer holds frozen), Hogwild-like
shared-memory parameters stepped by another worker's optimizer, a Lookahead wrapper's slow-weight sync. The
Hogwild loop without ``share_memory()`` is the control: an optimizer trackdiag was not given moves the weights.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from _harness import styles_report, local_session, one_thread
from trackdiag.core.record import read_records



REPORT = styles_report()
STYLES = ["gan", "two_opt_disjoint"]  # two components with one optimizer each; one model with two optimizers


@pytest.mark.parametrize("style", STYLES)
def test_reversed_ema_is_caught_in_the_style(style: str) -> None:
    row = REPORT.run_case((style, "advanced", 0, "reversed_ema", REPORT.fault_steps("reversed_ema", 300)))
    said = [(a["kind"], a["severity"], a["step"], a.get("raised_at"), a["where"]) for a in row["alerts"]]
    first = row["first"]
    assert first is not None and first["kind"] == "weights_moved" and first["severity"] == "warning", said
    # the pull starts after step 40's optimizer step: first seen between steps 49 and 50 (advanced logs every 10)
    assert first["step"] == REPORT.ONSET + 10 and first["raised_at"] == REPORT.ONSET + 20, said
    assert REPORT.verdict(row) == "caught", said


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=gen)
    return x, (x[:, :4] * 2).argmax(1)


def _loop(tmp: Path, model: nn.Module, opt: Any, steps: int, after_step: Callable[[int], None] = lambda s: None,
          loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, handed: Any = None,
          stepper: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> Any:
    """A plain classification loop; ``after_step(step)`` runs after the optimizer's step, before ``diag.step``."""
    x, y = _data()
    gen = torch.Generator().manual_seed(2)
    loss_of = loss_of or (lambda xb, yb: F.cross_entropy(model(xb), yb))
    diag = local_session(model, handed if handed is not None else opt, tmp, "advanced")
    with one_thread(), diag:
        for step in range(steps):
            i = torch.randint(0, len(x), (32,), generator=gen)
            if stepper is not None:
                loss = stepper(x[i], y[i])
            else:
                opt.zero_grad()
                loss = loss_of(x[i], y[i])
                loss.backward()
                opt.step()
            after_step(step)
            diag.step(loss.detach())
    return diag


def _moved(diag: Any) -> list[tuple[int, float]]:
    return [(r.step, r.scalars["diag/moved/ratio"]) for r in read_records(diag.summary()["output_dir"])
            if "diag/moved/ratio" in r.scalars]


def _warnings(diag: Any) -> list[tuple[str, int, str]]:
    return [(a.kind, a.step, a.where) for a in diag.alerts if a.severity in ("warning", "critical")]


def _fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """The probe's fingerprint computed another way: per tensor, in float64, from a full copy (of a tensor over its
    component's ``cap_of`` values, of the same evenly spaced runs the probe reads: ``sample_of`` the copy)."""
    from trackdiag.probes.moved import cap_of, sample_of

    copies = [sample_of(p.detach().double(), cap_of(len(params))) for p in params]
    return torch.tensor([[float(torch.linalg.vector_norm(c, 2)) for c in copies], [float(c.abs().sum()) for c in copies],
                         [float(c.sum()) for c in copies]], dtype=torch.float64)


@pytest.mark.parametrize("width,depth", [(32, 1), (300, 1), (128, 12), (32, 22)],
                         ids=["small", "sampled", "many", "segmented"])
def test_measured_movement_matches_full_copies(tmp_path: Path, width: int, depth: int, monkeypatch) -> None:
    """A reversed EMA from step 20: at each logging step the recorded ratio equals the one computed from full
    float64 copies taken after step D-1's update, before step D's and after it (the same definition: tensors
    whose move is not a pure shrink, their relative fingerprint changes over the optimizer's). ``sampled``: a
    300 x 300 hidden layer (90,000 values) read on its ``sample_of``; ``many``: 30 tensors, each 128 x 128 weight
    read on 8,704 of its 16,384 values (the component's share of the budget); ``segmented``: 92 tensors (22 blocks of
    Linear, LayerNorm, Tanh), fingerprinted from one copy of their values (``SEGMENTED``); caught at the same step."""
    from trackdiag.probes.moved import SEGMENTED, cap_of

    torch.manual_seed(0)
    block = (lambda: (nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh())) if depth > 20 else \
        (lambda: (nn.Linear(width, width), nn.Tanh()))
    hidden = [m for _ in range(depth) for m in block()]
    model = _mlp() if depth == 1 and width == 32 else nn.Sequential(nn.Linear(16, width), nn.Tanh(), *hidden,
                                                                    nn.Linear(width, 4))
    sizes = [p.numel() for p in model.parameters()]
    assert (max(sizes) > cap_of(len(sizes))) == (width in (300, 128)), (max(sizes), cap_of(len(sizes)))
    assert (len(sizes) > SEGMENTED) == (depth == 22), len(sizes)
    import trackdiag.probes.moved as moved

    segments: list[int] = []  # the fingerprints taken by the segmented path, by their tensor count
    whole = moved.segmented
    monkeypatch.setattr(moved, "segmented", lambda ts: segments.append(len(ts)) or whole(ts))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    params = list(model.parameters())
    anchor: list[torch.Tensor] = []
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # step -> (fingerprint after its update, after the pull)

    def after_step(step: int) -> None:
        before = _fingerprint(params)
        if step >= 20:
            with torch.no_grad():
                if not anchor:
                    anchor.extend(p.detach().clone() for p in params)
                for p, a in zip(params, anchor):
                    p.copy_(0.99 * a + 0.01 * p)
        copies[step] = (before, _fingerprint(params))

    diag = _loop(tmp_path, model, opt, 80, after_step)
    measured = dict(_moved(diag))
    assert sorted(measured) == [10, 20, 30, 40, 50, 60, 70], measured
    for step, value in measured.items():
        pre, post = copies[step - 1][1], copies[step][0]
        between, own = pre - copies[step - 1][0], post - pre
        scale = torch.stack([pre[0], pre[1], pre[1]])
        shrink = (between[0] <= 1e-6 * pre[0]) & (between[1] <= 1e-6 * pre[1]) & (between[2].abs() <= -between[1] + 1e-6 * pre[1])
        num = ((between.abs() / scale).sum(0) * (~shrink & (between != 0).any(0))).sum()
        expected = float(num / (own.abs() / scale).sum())
        if step <= 20:
            assert value == 0.0 and expected == 0.0, (step, value)
        else:
            assert expected > 0.05 and value == pytest.approx(expected, rel=2e-3, abs=1e-6), (step, value, expected)
    assert [(k, s) for k, s, _ in _warnings(diag)] == [("weights_moved", 30)], _warnings(diag)
    assert set(segments) == ({len(sizes)} if depth == 22 else set()), segments


def test_weight_clipping_after_the_step_is_silent(tmp_path: Path) -> None:
    """WGAN's critic: RMSprop, then every weight clamped to [-0.01, 0.01] (most of them sit on the bound)."""
    model = _mlp()
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-4)

    def clip(step: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.01, 0.01)

    diag = _loop(tmp_path, model, opt, 100, clip, loss_of=lambda xb, yb: -model(xb)[:, 0].mean() + model(xb.flip(0))[:, 0].mean())
    moved = _moved(diag)
    assert moved and all(v == 0.0 for _, v in moved), moved
    assert not _warnings(diag), _warnings(diag)


@pytest.mark.parametrize("hand", ["sam", "base"])
def test_sam_two_pass_is_silent(tmp_path: Path, hand: str) -> None:
    """davda54/sam (the corpus' ``sam_two_pass``): the weights climb to w + e(w) for the second pass and are put
    back before the base optimizer steps. Handed to trackdiag as the SAM object (a wrapper: left out), or as its
    base optimizer (judged: the weights are back, bit for bit, when the base optimizer steps)."""
    from _styles.sam_two_pass import SAM

    model = _mlp()
    sam = SAM(model.parameters(), torch.optim.SGD, rho=0.05, lr=0.05, momentum=0.9)

    def two_pass(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        sam.first_step(zero_grad=True)
        F.cross_entropy(model(xb), yb).backward()
        sam.second_step(zero_grad=True)
        return loss

    diag = _loop(tmp_path, model, None, 80, handed=sam if hand == "sam" else sam.base_optimizer, stepper=two_pass)
    moved = _moved(diag)
    assert (not moved) if hand == "sam" else (moved and all(v == 0.0 for _, v in moved)), moved
    assert not _warnings(diag), _warnings(diag)


def test_separate_ema_in_a_submodule_is_silent(tmp_path: Path) -> None:
    """A correct EMA (``ema_p.lerp_(p, 1 - decay)``) kept as a submodule of the watched model; the optimizer was
    built from ``model.parameters()``, so it holds the EMA's tensors too (frozen: ``requires_grad=False``)."""

    class WithEma(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()
            self.ema = copy.deepcopy(self.net).requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    model = WithEma()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def ema(step: int) -> None:
        with torch.no_grad():
            for e, p in zip(model.ema.parameters(), model.net.parameters()):
                e.lerp_(p, 0.01)

    diag = _loop(tmp_path, model, opt, 80, ema)
    moved = _moved(diag)
    assert moved and all(v == 0.0 for _, v in moved), moved
    assert not _warnings(diag), _warnings(diag)


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "control"])
def test_hogwild_shared_parameters(tmp_path: Path, shared: bool) -> None:
    """Hogwild: the model's tensors in shared memory, stepped between this worker's steps by another process (here
    in-process: the other worker's plain SGD update on other batches, which no hook of this process sees). Shared
    tensors are not judged: silent. The control, the same loop without ``share_memory()``: something other than the
    watched optimizer moves the weights, ``weights_moved``."""
    model = _mlp()
    if shared:
        model.share_memory()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()

    def other_worker(step: int) -> None:
        i = torch.randint(0, len(x), (32,), generator=torch.Generator().manual_seed(100 + step))
        opt.zero_grad()
        F.cross_entropy(model(x[i]), y[i]).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.05 * p.grad)
        opt.zero_grad()

    diag = _loop(tmp_path, model, opt, 60, other_worker)
    if shared:
        assert not _warnings(diag), _warnings(diag)
    else:
        found = _warnings(diag)
        assert found and found[0][:2] == ("weights_moved", 10), found
        assert "0 (Linear)" in found[0][2] or "2 (Linear)" in found[0][2], found


def test_lookahead_wrapper_is_silent(tmp_path: Path) -> None:
    """Lookahead (k=5, alpha=0.5) around Adam: every 5 steps the wrapper pulls the fast weights back to the slow ones,
    after the inner optimizer's step. A wrapper's own moves are not judged (the component is left out)."""

    class Lookahead:
        def __init__(self, optimizer: torch.optim.Optimizer, k: int = 5, alpha: float = 0.5) -> None:
            self.optimizer, self.k, self.alpha, self.n = optimizer, k, alpha, 0
            self.param_groups = optimizer.param_groups
            self.slow = [p.detach().clone() for g in self.param_groups for p in g["params"]]

        def zero_grad(self) -> None:
            self.optimizer.zero_grad()

        @torch.no_grad()
        def step(self) -> None:
            self.optimizer.step()
            self.n += 1
            if self.n % self.k == 0:
                for s, p in zip(self.slow, (p for g in self.param_groups for p in g["params"])):
                    s.add_(p - s, alpha=self.alpha)
                    p.copy_(s)

    model = _mlp()
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=3e-3))
    diag = _loop(tmp_path, model, opt, 60)
    assert not _moved(diag) and not _warnings(diag), (_moved(diag), _warnings(diag))

"""Issue 44: the gradient tap's per-layer hooks go once the sentinel has stood for them (``CompTap.thin_out``), and
come back when a step's optimizer finds no pass the sentinel saw. Checked: the hook calls per backward pass before
and after (counted with ``sys.setprofile``), and the pre-clip global norm against ``clip_grad_norm_``'s return value at
every step, through a change of phase whose backward passes no longer reach the sentinel.
"""
from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from conftest import LEAN_PROBES
from trackdiag.capture.tap_hooks import THIN_AFTER
from trackdiag.core.record import read_records
from _clip import clip_checked

DEPTH = 6


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 32), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    # the sentinel: the smallest tensor of the end layers but the head's bias (pick_sentinel): the first layer's bias
    return nn.Sequential(*layers, nn.Linear(32, 4))


def _hook_calls(loss: torch.Tensor) -> int:
    """The tap's tensor-hook calls in ``loss.backward()`` (a layer's ``fire``, the sentinel's ``watch``)."""
    n = [0]

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name in ("fire", "watch") and frame.f_code.co_filename.endswith("tap_hooks.py"):
            n[0] += 1

    sys.setprofile(prof)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return n[0]


def _series(out_dir: Any, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out_dir) for k, s, v in r.points() if k == key}


def test_the_sentinel_stands_alone_after_whole_passes_and_the_norm_stays_exact(tmp_path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=5, sinks=["local"], output_dir=str(tmp_path),
                                 budget=None, probes=LEAN_PROBES)
    gen = torch.Generator().manual_seed(1)
    calls: dict[int, int] = {}
    expected: dict[int, float] = {}
    aux_from = THIN_AFTER + 10  # from here a pass skips the first layer (and its sentinel): a pretext phase on the rest
    for step in range(aux_from + 10):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        if step < aux_from:
            loss = F.cross_entropy(model(x), y)
        else:
            loss = F.cross_entropy(model[2:](torch.randn(32, 32, generator=gen)), y)  # every layer but the first
        calls[step] = _hook_calls(loss)
        expected[step] = clip_checked(model.parameters(), 0.5).item()  # pre-clip, clipped
        opt.step()
        opt.zero_grad(set_to_none=True)
        diag.step(loss)
    diag.close()
    # every built-in layer's hook (the head's weight stands for its bias, the sentinel) until the passes have shown
    # that the sentinel is reached whenever the model is; then the sentinel's alone
    assert calls[0] == DEPTH and all(calls[s] == DEPTH for s in range(THIN_AFTER - 1)), calls
    assert all(calls[s] == 1 for s in range(THIN_AFTER + 1, aux_from)), calls
    # the pretext phase reaches every layer but the sentinel's: its first step finds no pass measured and the hooks
    # come back (that step read at the optimizer, after the clip); the passes after it are measured again
    assert calls[aux_from] == 0 and all(calls[s] == DEPTH - 1 for s in range(aux_from + 1, aux_from + 10)), calls
    got = _series(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == sorted(expected)
    for step, ref in expected.items():
        if step == aux_from:
            assert got[step] == pytest.approx(min(ref, 0.5), rel=1e-4)  # the clipped gradient, read at the step
        else:
            assert got[step] == pytest.approx(ref, rel=1e-5), step


def test_a_model_whose_passes_skip_layers_keeps_its_hooks(tmp_path) -> None:
    """Passes that alternate between the whole model and its trunk (the head's sentinel not reached every time) never
    make a run of whole passes: every hook stays, and every pass is measured."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=5, sinks=["local"], output_dir=str(tmp_path),
                                 budget=None, probes=LEAN_PROBES)
    gen = torch.Generator().manual_seed(1)
    expected: dict[int, float] = {}
    for step in range(3 * THIN_AFTER):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        loss = F.cross_entropy(model(x), y) if step % 2 == 0 else model[:4](x).pow(2).mean()
        loss.backward()
        expected[step] = clip_checked(model.parameters(), 0.5).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        diag.step(loss)
    st = diag._tap.states[""]
    assert not st.thin and len(st.layer_handles) == DEPTH - 1
    diag.close()
    got = _series(tmp_path, "diag/grad/global_norm")
    assert all(got[s] == pytest.approx(ref, rel=1e-5) for s, ref in expected.items() if s > 3 and s % 2 == 0)

"""``optimizer_restepped``: ``optimizer.step()`` twice per iteration on the same gradients (a silent error no issue
named: a ``train_step`` helper that steps and a loop that steps again; ``scaler.step(opt)`` then ``opt.step()``).

Planted: Adam stepped twice after each backward pass (at ``basic`` and ``advanced``), and a ``GradScaler`` step followed
by a plain one: a warning at step 0, and the record's count of repeats equals the loop's own count of second calls.
Healthy twins that step more than once per ``step()`` call or rebuild gradients without a tapped backward: L-BFGS (a
closure), gradients assigned by hand each step (DP-SGD), a critic stepped 5 times per generator step (each after its
own backward), gradient accumulation, ``zero_grad(set_to_none=False)``: silent.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}
W = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))


def _data(gen: torch.Generator, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 8, generator=gen)
    return x, (x @ W).argmax(1)


def _session(model, opt, tmp_path, level: str = "advanced") -> trackdiag.Diagnostics:
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=OFF)


def _warned(diag) -> list:
    return [(a.kind, a.step) for a in diag.alerts if a.severity != "info"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))


@pytest.mark.parametrize("level", ["basic", "advanced"])
@pytest.mark.parametrize("how", ["twice", "scaler_then_step"])
def test_an_optimizer_stepped_twice_on_the_same_gradients_is_said(tmp_path, level: str, how: str) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if how == "scaler_then_step" else None
    gen = torch.Generator().manual_seed(1)
    seconds_at: list[int] = []  # second calls up to each step
    with one_thread(), _session(model, opt, tmp_path, level) as diag:
        for _ in range(60):
            x, y = _data(gen)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.step()  # the stray second call
            seconds_at.append(len(seconds_at) + 1)
            diag.step(loss, outputs=out, batch=(x, y))
    found = [a for a in diag.alerts if a.kind == "optimizer_restepped"]
    assert [(a.step, a.severity) for a in found] == [(0, "warning")], _warned(diag)
    assert "Adam.step() ran again on the gradients of its previous step" in found[0].message
    # the reference: the loop's own count of second calls up to each record's step (all of them: GradScaler's steps
    # here are never skipped, the scaled gradients stay finite)
    totals = [(r.step, r.tables["diag/opt/restepped"]["total"]) for r in read_records(tmp_path)
              if "diag/opt/restepped" in r.tables]
    assert totals and all(total == seconds_at[step] for step, total in totals), (totals, seconds_at)
    assert _warned(diag) == [("optimizer_restepped", 0)]


def _healthy(tmp_path, style: str) -> trackdiag.Diagnostics:
    gen = torch.Generator().manual_seed(2)
    model = _model()
    if style == "lbfgs":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    elif style == "critic":
        critic = nn.Sequential(nn.Linear(3, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = {"model": torch.optim.Adam(model.parameters(), lr=1e-3), "critic": torch.optim.Adam(critic.parameters(), lr=1e-3)}
        model = {"model": model, "critic": critic}
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with one_thread(), _session(model, opt, tmp_path) as diag:
        for _ in range(60):
            x, y = _data(gen)
            if style == "lbfgs":
                def closure():
                    opt.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss
                loss = opt.step(closure)
                diag.step(loss.detach(), batch=(x, y))
            elif style == "dpsgd":  # per-sample gradients clipped, noised and assigned by hand; no backward on the model
                params = dict(model.named_parameters())
                grads = torch.func.vmap(torch.func.grad(lambda p, xi, yi: F.cross_entropy(
                    torch.func.functional_call(model, p, (xi[None],)), yi[None])), in_dims=(None, 0, 0))(
                    {k: v.detach() for k, v in params.items()}, x, y)
                for k, p in params.items():
                    p.grad = grads[k].mean(0) + 0.01 * torch.randn_like(p)
                opt.step()
                opt.zero_grad()
                with torch.no_grad():
                    diag.step(F.cross_entropy(model(x), y), batch=(x, y))
            elif style == "critic":  # 5 critic steps per model step, each after its own backward
                m, c = model["model"], model["critic"]
                for _ in range(5):
                    lc = c(m(x).detach()).mean() ** 2
                    opt["critic"].zero_grad()
                    lc.backward()
                    opt["critic"].step()
                lm = F.cross_entropy(m(x), y)
                opt["model"].zero_grad()
                lm.backward()
                opt["model"].step()
                diag.step({"model": lm, "critic": lc})
            elif style == "accumulate":  # 4 micro-batches per step
                for _ in range(4):
                    xb, yb = _data(gen, 8)
                    (F.cross_entropy(model(xb), yb) / 4).backward()
                opt.step()
                opt.zero_grad(set_to_none=False)
                diag.step(F.cross_entropy(model(x), y).detach(), batch=(x, y))
    return diag


@pytest.mark.parametrize("style", ["lbfgs", "dpsgd", "critic", "accumulate"])
def test_steps_on_fresh_gradients_are_silent(tmp_path, style: str) -> None:
    diag = _healthy(tmp_path, style)
    assert not [a for a in diag.alerts if a.kind == "optimizer_restepped"], _warned(diag)
    assert not any("same gradients is off" in n for n in diag.summary()["notes"])

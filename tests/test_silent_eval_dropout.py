"""A silent error no issue named: dropout that ``model.eval()`` does not reach (``eval_dropout``).

``F.dropout(h, 0.5)`` in a ``forward`` without ``training=self.training`` (its default is ``training=True``): the
model is evaluated, and later serves, with half its units dropped at random. On the digits MLP the same evaluation
gives 95.2 % and 96.0 % accuracy twice in a row; the previous build said nothing (or ``overfitting``, from the noise).

Now ``eval_dropout`` (warning) at the second ``log_eval`` (the spy starts at the first), naming the module whose code
called it and its ``p``, at every preset, for ``F.dropout``, ``torch.dropout``, ``F.dropout2d`` and the attention
dropout of ``F.scaled_dot_product_attention(..., dropout_p=0.2)`` not gated by ``self.training``. Healthy twins,
silent: ``training=self.training``, ``nn.Dropout`` modules, Monte Carlo dropout (``nn.Dropout`` modules put back in
training mode on purpose), and the spied evaluation gives the same numbers as an unwatched one.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _harness import one_thread
from conftest import batches
from trackdiag.core.record import read_records

OFF = {"report": {"enabled": False}, "histograms": {"enabled": False}, "landscape": {"enabled": False}}


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.fc, self.form = nn.Linear(64, 64), form
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc(x))
        if self.form == "functional":
            return F.dropout(h, 0.3)  # the fault: training defaults to True
        if self.form == "torch_dropout":
            return torch.dropout(h, 0.3, True)
        if self.form == "sdpa":  # attention dropout not gated by the mode (dropout_p=0.2 always)
            q = h.view(-1, 4, 16)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.2).reshape(-1, 64)
        if self.form == "sdpa_gated":
            q = h.view(-1, 4, 16)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.2 if self.training else 0.0).reshape(-1, 64)
        if self.form == "dropout2d":
            return F.dropout2d(h.view(-1, 16, 2, 2), p=0.2).view(-1, 64)
        if self.form == "with_mode":
            return F.dropout(h, 0.3, training=self.training)
        return self.drop(h)  # "module", "mc_dropout"


class Net(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.block = Block(form)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _run(tmp_path, digits, form: str, level: str = "advanced", steps: int = 100, every: int = 20):
    x, y = digits
    torch.manual_seed(0)
    net = Net(form)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    xv, yv = x[1400:], y[1400:]
    seen: list[tuple[float, float]] = []
    with one_thread(), trackdiag.Diagnostics(net, opt, level=level, sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        data = batches(x[:1400], y[:1400])
        for step in range(steps):
            xb, yb = next(data)
            out = net(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
            if (step + 1) % every == 0:
                net.eval()
                if form == "mc_dropout":
                    net.block.drop.train()  # Monte Carlo dropout, on purpose
                with torch.no_grad():
                    torch.manual_seed(step)
                    watched = F.cross_entropy(net(xv), yv).item()  # the first eval call: spied on when due
                    torch.manual_seed(step)
                    again = F.cross_entropy(net(xv), yv).item()
                net.train()
                seen.append((watched, again))
                diag.log_eval(loss=watched)
    return diag, seen


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_functional_dropout_left_on_at_evaluation_is_found(tmp_path, digits, level: str):
    diag, _ = _run(tmp_path, digits, "functional", level=level)
    found = [a for a in diag.alerts if a.kind == "eval_dropout"]
    assert [(a.step, a.severity, a.where) for a in found] == [(39, "warning", "block")], diag.alerts
    assert "block (p=0.3)" in found[0].message and "training=self.training" in found[0].hint
    tables = [r.tables.get("diag/model/eval_dropout") for r in read_records(tmp_path) if "diag/eval/loss" in r.scalars]
    assert tables == [None, {"block": 0.3}, None, None, None], tables  # found at the first spied evaluation, once


@pytest.mark.parametrize("form,p", [("torch_dropout", 0.3), ("dropout2d", 0.2), ("sdpa", 0.2)])
def test_other_functional_forms_are_found(tmp_path, digits, form: str, p: float):
    diag, _ = _run(tmp_path, digits, form)
    found = [a for a in diag.alerts if a.kind == "eval_dropout"]
    assert [(a.step, a.where, a.value) for a in found] == [(39, "block", pytest.approx(p))], diag.alerts


@pytest.mark.parametrize("form", ["with_mode", "module", "mc_dropout", "sdpa_gated"])
def test_dropout_that_follows_the_mode_or_is_kept_on_purpose_is_silent(tmp_path, digits, form: str):
    diag, seen = _run(tmp_path, digits, form)
    assert not [a for a in diag.alerts if a.severity != "info"], diag.alerts
    assert all(w == a for w, a in seen), seen  # the spied call computes what the unwatched one does
    if form != "mc_dropout":
        assert len({round(w, 6) for w, _ in seen}) == len(seen)  # the model trains between evaluations


def test_a_spied_call_that_raises_leaves_no_mode_behind(tmp_path, digits):
    """The spy is a context the model's call slot enters after the watchers and leaves however the call ends: an
    evaluation call that raises (an OOM retried with a smaller batch) leaves no TorchFunctionMode on the stack."""
    from torch.overrides import _get_current_function_mode_stack

    class Flaky(Net):
        raised, armed = 0, False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] > 300 and Flaky.armed:
                Flaky.raised, Flaky.armed = Flaky.raised + 1, False
                raise RuntimeError("out of memory (planted)")
            return super().forward(x)

    x, y = digits
    torch.manual_seed(0)
    net = Flaky("functional")
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    with one_thread(), trackdiag.Diagnostics(net, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                             probes=OFF, budget=None) as diag:
        data = batches(x[:1400], y[:1400])
        for step in range(60):
            xb, yb = next(data)
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss)
            if (step + 1) % 20 == 0:
                net.eval()
                with torch.no_grad():
                    Flaky.armed = step == 39  # the first spied evaluation (the watch starts at the first)
                    try:
                        net(x[1400:])  # the spied call: raises at step 39
                    except RuntimeError:
                        pass
                    assert not _get_current_function_mode_stack()
                    val = sum(F.cross_entropy(net(xc), yc).item() for xc, yc in zip(x[1400:].chunk(2), y[1400:].chunk(2)))
                net.train()
                diag.log_eval(loss=val / 2)
    assert Flaky.raised == 1
    assert [a.step for a in diag.alerts if a.kind == "eval_dropout"] == [59]  # spied again at the next evaluation

"""One incident, one alert (issue 30 items 3-4): repeats and consequences of an open incident are
folded into it with a count and a last step; a gradient-norm collapse is judged like an explosion."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread, quiet_probes
from trackdiag.core.alert import Alert
from trackdiag.alerts.book import AlertBook
from trackdiag.core.record import Record


class Poison(nn.Module):
    """Multiplies by ``log(1 - fault)``: NaN/-inf once the fault buffer is 1."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fault", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.log1p(-self.fault) * 0 if not self.fault.item() else x * torch.log1p(-self.fault)


def test_a_nan_that_never_recovers_is_one_alert_and_its_consequences_are_folded(tmp_path) -> None:
    """A NaN from step 100 to the end with validation every 20 steps: one ``nonfinite_loss`` alert whose
    count and last step grow (54000e6: an evaluation record closed the incident, and the alert came back
    every 100 steps; dead units on the NaN activations were raised as a new fault)."""
    xtr, ytr, xva, yva = digits()
    torch.manual_seed(0)
    poison = Poison()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), poison, nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["local"], output_dir=str(tmp_path),
                                 probes=quiet_probes())
    with one_thread(), diag:
        for step in range(400):
            poison.fault.fill_(1.0 if step >= 100 else 0.0)
            idx = torch.randint(len(xtr), (64,), generator=gen)
            out = model(xtr[idx])
            loss = F.cross_entropy(out, ytr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xtr[idx], ytr[idx]))
            if step % 20 == 19:
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xva), yva).item())
    after = [(a.kind, a.step) for a in diag.alerts if a.step >= 100 and a.severity != "info"]
    assert after == [("nonfinite_loss", 100)], diag.alerts
    nan = next(a for a in diag.alerts if a.kind == "nonfinite_loss")
    assert nan.count > 10 and nan.last_step >= 390
    incident = next(i for i in diag.summary()["incidents"] if i["kind"] == "nonfinite_loss")
    assert incident["count"] == nan.count and incident["last_step"] == nan.last_step


def _finding(kind: str, step: int, severity: str = "warning", where: str = "") -> Alert:
    return Alert(kind, step, severity, "m", where=where, last_step=step)


def test_incident_book_folds_repeats_reraises_when_it_worsens_or_comes_back() -> None:
    book = AlertBook()
    assert book.admit(_finding("loss_spike", 10), cooldown=100)
    assert not book.admit(_finding("loss_spike", 60), cooldown=100)  # the same incident, still open
    assert book.admit(_finding("loss_spike", 90, "critical"), cooldown=100)  # worsened: raised again
    assert not book.admit(_finding("loss_spike", 150, "warning"), cooldown=100)
    assert book.admit(_finding("loss_spike", 400), cooldown=100)  # quiet for 250 steps: it came back
    assert [(a.step, a.count, a.last_step) for a in book.alerts] == [(10, 2, 60), (90, 2, 150), (400, 1, 400)]
    root = book.absorbing(_finding("dead_units", 420))
    assert root is None  # a warning incident absorbs nothing
    book.admit(_finding("grad_explosion", 500, "critical"), cooldown=100)
    root = book.absorbing(_finding("dead_units", 520))
    assert root is not None and root.alert.kind == "grad_explosion"
    book.suppress(_finding("dead_units", 520), root)
    assert book.summary()[-1]["consequences"] == {"dead_units": 1}
    assert book.absorbing(_finding("label_leak", 530)) is None  # set-up and data findings stand on their own
    assert book.absorbing(_finding("nonfinite_loss", 530)) is None  # a NaN is always told


def _judge(rule: Any, grad: dict[int, float], loss: dict[int, float], every: int = 10) -> list[Alert]:
    from trackdiag.capture.components import build_components

    comps = build_components(nn.Linear(2, 2), None, 64)
    found: list[Alert] = []
    history: list[Record] = []
    for end in range(every - 1, max(grad) + 1, every):
        window = [s for s in sorted(grad) if end - every < s <= end]
        rec = Record(step=end, series={"diag/grad/global_norm": [(s, grad[s]) for s in window],
                                       "diag/loss": [(s, loss[s]) for s in window]})
        found += rule.check(rec, history, comps)
        history.append(rec)
    return found


def test_gradient_norm_collapse_with_a_flat_loss_is_a_warning_and_convergence_is_not() -> None:
    """LR x1000 under BatchNorm: the weights grow, the pre-clip norm falls 70-fold in a few steps
    (7 -> 0.1) while the loss stays; a run converging (norm and loss falling together, slowly) is not."""
    from trackdiag.rules.vanishing import GradVanishing

    stuck_g = {s: 7.0 + 0.3 * ((s * 7) % 5) if s < 120 else 0.1 + 0.01 * (s % 3) for s in range(200)}
    stuck_l = {s: 1.2 + 0.05 * ((s * 3) % 4) for s in range(200)}
    found = _judge(GradVanishing(), stuck_g, stuck_l)
    assert [(a.kind, a.severity) for a in found] == [("grad_vanishing", "critical")]
    assert 118 <= found[0].step <= 125 and set(found[0].evidence) == {"persistent", "loss"}
    conv_g = {s: 7.0 * 0.985 ** s for s in range(300)}
    conv_l = {s: 2.3 * 0.985 ** s for s in range(300)}
    assert _judge(GradVanishing(), conv_g, conv_l) == []


def test_console_summary_for_every_spelling_unless_turned_off(tmp_path, capsys) -> None:
    """``sinks=["local"]`` printed nothing at the end (issue 30 item 5) while ``diag/sink=local`` printed
    the summary: now both print it, and ``sink.console.enabled=false`` silences it."""
    def run(**kw: Any) -> str:
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with trackdiag.Diagnostics(model, opt, level="basic", output_dir=str(tmp_path / str(len(kw))), **kw) as diag:
            for _ in range(3):
                loss = model(torch.randn(8, 4)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                diag.step(loss)
        return capsys.readouterr().err

    printed = run(sinks=["local"])
    assert "health" in printed and str(tmp_path / "1") in printed
    assert run(sinks=["local"], sink={"console": {"enabled": False}}) == ""


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_a_nan_only_in_the_gradients_is_one_alert_at_its_first_step(tmp_path, level: str) -> None:
    """The loss passed stays finite while every backward pass makes NaN gradients from step 30 on (a sqrt or
    norm at 0 does this): one ``nonfinite_grad`` at step 30, at ``basic`` too (gradient tensors are checked
    only at its logging steps, 50: the every-step norm names the step), never a second one while it lasts
    (the tensor check names a layer, the every-step norm the component: one incident)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(tmp_path), probes=quiet_probes())
    with diag:
        for step in range(120):
            x = torch.randn(64, 4)
            out = model(x)
            if step >= 30:
                out = out * torch.log(torch.zeros(())) * 0  # NaN forward into the gradients only
            opt.zero_grad()
            (-(out * x[:, :2]).mean()).backward()
            opt.step()
            diag.step(x.pow(2).mean())
    grads = [a for a in diag.alerts if a.kind == "nonfinite_grad"]
    assert [(a.step, a.severity) for a in grads] == [(30, "critical")], diag.alerts
    assert diag.summary()["alerts"]["nonfinite_grad"]["last_step"] >= 100  # found again in every window, folded in

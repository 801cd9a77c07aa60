"""Loops that back-propagate for their *inputs'* gradient (adversarial training, PGD) before the
real backward pass: the extra pass's parameter gradients are zeroed on purpose, which looks exactly
like gradients reset inside an accumulation window. Found on a public FGSM-style loop that raised
``accumulation_reset`` critical at step 0 of a healthy run. Now: an ``info`` finding that says why,
the pre-clip norm is the pass the optimizer used, and the real accumulation mistake (also in a model
fed another component's output, whose input requires grad through parameters) stays critical. Also
per-sample gradients under ``torch.func`` (DP-SGD): nothing is watched inside the transform."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from _zoo_a import digits, one_thread, quiet_probes
from trackdiag.capture.input_grads import asks_input_grad
from trackdiag.core.record import read_records

LEVELS = ["basic", "advanced", "extreme"]


def points(out, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == key}


def session(model, opt, out, level, **kw):
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), probes=quiet_probes(), **kw)


def loud(diag) -> list[tuple[str, str, int]]:
    return [(a.kind, a.severity, a.step) for a in diag.alerts if a.severity != "info"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("attack", ["fgsm", "pgd"])
def test_adversarial_training_is_not_an_accumulation_reset(tmp_path, level, attack) -> None:
    xtr, ytr, _, _ = digits()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    refs = {}
    diag = session(model, opt, tmp_path, level, every=5)
    with one_thread(), diag:
        for step in range(30):
            idx = torch.randint(len(xtr), (64,), generator=g)
            x, y = xtr[idx].clone(), ytr[idx]
            if attack == "fgsm":  # the input itself is the leaf that asks for its gradient
                x.requires_grad_(True)
                model.zero_grad()
                F.cross_entropy(model(x), y).backward()
                x_adv = (x + 0.1 * x.grad.sign()).clamp(0, 1).detach()
            else:  # PGD: a perturbation leaf; the model sees x + delta, two steps of ascent
                delta = torch.zeros_like(x, requires_grad=True)
                for _ in range(2):
                    F.cross_entropy(model((x + delta).clamp(0, 1)), y).backward()
                    delta = (delta + 0.05 * delta.grad.sign()).clamp(-0.1, 0.1).detach().requires_grad_(True)
                x_adv = (x + delta).clamp(0, 1).detach()
            opt.zero_grad()
            out = model(x_adv)
            loss = F.cross_entropy(out, y)
            loss.backward()
            refs[step] = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])).item()
            opt.step()
            diag.step(loss, outputs=out, batch=(x_adv, y))
    assert loud(diag) == []
    found = [a for a in diag.alerts if a.kind == "accumulation_reset"]
    assert found and found[0].step == 0 and found[0].severity == "info", found
    assert "asked for its own gradient" in found[0].message
    got = points(tmp_path, "diag/grad/global_norm")  # the pass the optimizer used, not the input's
    assert sorted(got) == list(range(30))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("level", LEVELS)
def test_accumulation_reset_stays_critical_for_a_component_fed_another_components_output(tmp_path, level) -> None:
    """The decoder's input requires grad (the encoder's output): no exemption; the zero_grad placed
    inside the 4-micro-batch loop from step 6 is caught at step 6."""
    xtr, ytr, _, _ = digits()
    torch.manual_seed(0)
    enc, dec = Encoder(), nn.Linear(32, 10)
    opts = {"encoder": torch.optim.Adam(enc.parameters(), 1e-3), "decoder": torch.optim.Adam(dec.parameters(), 1e-3)}
    diag = session({"encoder": enc, "decoder": dec}, opts, tmp_path, level, every=5)
    with one_thread(), diag:
        for step in range(12):
            total = 0.0
            for micro in range(4):
                if step >= 6:  # the planted mistake: zeroed inside the accumulation window
                    for o in opts.values():
                        o.zero_grad()
                x, y = xtr[(step * 4 + micro) * 16:][:16], ytr[(step * 4 + micro) * 16:][:16]
                loss = F.cross_entropy(dec(enc(x)), y) / 4
                loss.backward()
                total += loss.detach()
            for o in opts.values():
                o.step()
                o.zero_grad()
            diag.step(total)
    found = sorted((a.where, a.step, a.severity) for a in diag.alerts if a.kind == "accumulation_reset")
    assert found == [("decoder", 6, "critical"), ("encoder", 6, "critical")], diag.alerts


def test_which_inputs_ask_for_their_gradient() -> None:
    """Reference: how each tensor was made."""
    enc = Encoder()
    x = torch.rand(4, 64)
    leaf = x.clone().requires_grad_(True)
    delta = torch.zeros_like(x, requires_grad=True)
    assert not asks_input_grad((x,), {})  # plain data
    assert asks_input_grad((leaf,), {})  # FGSM
    assert asks_input_grad(((x + delta).clamp(0, 1),), {})  # PGD: a few nodes to a non-parameter leaf
    assert not asks_input_grad((enc(x),), {})  # another module's output: its graph ends in parameters
    assert not asks_input_grad((enc.net[0].weight,), {})  # a parameter passed in (weight tying) is no input
    assert asks_input_grad((), {"inputs_embeds": leaf})  # by keyword
    assert asks_input_grad(([x, leaf],), {})  # inside a list
    with torch.no_grad():
        assert not asks_input_grad((x + 1,), {})


@pytest.mark.parametrize("late", ["adversarial", "accumulation_reset"])
def test_watching_rests_after_one_pass_steps_and_resumes_when_several_passes_begin(tmp_path, late) -> None:
    """30 clean steps (the inputs stop being watched at step 20), then from step 30 either FGSM
    training (silent: the first such step is not judged, the next ones are seen) or the
    accumulation mistake (critical, one step later than with watching on: step 31)."""
    from trackdiag.capture.forward_watch import FORWARD

    xtr, ytr, _, _ = digits()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    diag = session(model, opt, tmp_path, "basic", every=5)
    zg = next(p for p in diag.probes if p.name == "zerograd")
    watched = {}
    with one_thread(), diag:
        for step in range(40):
            x, y = xtr[step * 32:][:32].clone(), ytr[step * 32:][:32]
            watched[step] = bool(zg._stops) and id(model) in FORWARD._rpost
            if step >= 30 and late == "adversarial":
                x.requires_grad_(True)
                F.cross_entropy(model(x), y).backward()
                x = (x + 0.1 * x.grad.sign()).detach()
                opt.zero_grad()
            elif step >= 30:  # two micro-batches, zeroed between them
                F.cross_entropy(model(x[:16]), y[:16]).backward()
                opt.zero_grad()
                x, y = x[16:], y[16:]
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            diag.step(loss)
    assert all(watched[s] for s in range(21)) and not any(watched[s] for s in range(22, 31))
    assert all(watched[s] for s in range(31, 40))
    found = [(a.kind, a.severity, a.step) for a in diag.alerts if a.kind == "accumulation_reset"]
    if late == "adversarial":
        assert loud(diag) == [] and found == [("accumulation_reset", "info", 31)], diag.alerts
    else:
        assert found == [("accumulation_reset", "critical", 31)], diag.alerts


@pytest.mark.parametrize("level", LEVELS)
def test_per_sample_gradients_under_vmap_keep_every_probe_on(tmp_path, level) -> None:
    """DP-SGD by hand (Opacus's idea with torch.func): per-sample gradients by ``vmap(grad(...))`` over
    the model, clipped, noised and assigned to ``p.grad``; no ``backward()``. The module watchers used
    to keep the transform's batched tensors (the activations probe and the flight recorder then died
    on them); now nothing is watched inside a torch.func transform. The gradient norm is the one of
    the gradients assigned, by hand."""
    from torch.func import functional_call, grad, vmap

    xtr, ytr, _, _ = digits()
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.5)
    g = torch.Generator().manual_seed(0)
    per_sample = vmap(grad(lambda p, x, y: F.cross_entropy(functional_call(model, p, (x[None],)), y[None])),
                      in_dims=(None, 0, 0))
    refs = {}
    diag = session(model, opt, tmp_path, level, every=5)
    with one_thread(), diag:
        for step in range(12):
            x, y = xtr[step * 32:][:32], ytr[step * 32:][:32]
            gs = per_sample({k: v.detach() for k, v in model.named_parameters()}, x, y)
            norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in gs.values()))
            scale = (1.0 / (norms + 1e-6)).clamp(max=1.0)
            for k, p in model.named_parameters():
                clipped = (gs[k] * scale.view(-1, *[1] * (gs[k].dim() - 1))).sum(0)
                p.grad = (clipped + 0.1 * torch.randn(clipped.shape, generator=g)) / len(x)
            refs[step] = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()])).item()
            opt.step()
            opt.zero_grad()
            out = model(x)  # an ordinary forward for the record (accuracy, activations)
            diag.step(F.cross_entropy(out, y).detach(), outputs=out.detach(), batch=(x, y))
    assert diag.summary()["disabled_probes"] == {}
    assert loud(diag) == []
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(12))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step

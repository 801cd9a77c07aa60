"""Right numbers in the loops users write (issue: gradient truth).

Every test compares trackdiag's record against an independent reference computed in the loop
itself (``clip_grad_norm_``'s return value, norms by hand in float64), at every step."""
from __future__ import annotations

import copy
import logging
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
import _warm as warm
from _loops import (CharGPT, WordLM, batchify, char_batches, char_data, gpt_optimizer, lm_batches, ref_norm, repackage,
                    warmup_cosine, word_data)
from _zoo_a import one_thread, quiet_probes
from trackdiag.core.record import read_records
from _clip import clip_checked


def points(out, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == key}


def session(model, opt, out, level: str = "advanced", **kw):
    kw.setdefault("probes", quiet_probes())
    return trackdiag.Diagnostics(model, opt, level=level, sinks=["local"], output_dir=str(out), **kw)


def test_hand_written_sgd_lstm_lm_with_clipping(tmp_path) -> None:
    """PyTorch's word_language_model: no optimizer object, clip at 0.25, p.data.add_(p.grad, alpha=-lr):
    the pre-clip norm at every step, update ratios between step() calls, and a note saying what needs
    an optimizer."""
    data, ntok = word_data()
    torch.manual_seed(0)
    model = WordLM(ntok)
    train = batchify(data, 8)
    refs, lr = {}, 5.0
    with one_thread():
        diag = session(model, None, tmp_path, every=5)
        with diag:
            hidden = model.init_hidden(8)
            for step, (x, y) in zip(range(25), lm_batches(train, 12)):
                hidden = repackage(hidden)
                model.zero_grad()
                out, hidden = model(x, hidden)
                loss = F.cross_entropy(out.view(-1, ntok), y.reshape(-1))
                loss.backward()
                refs[step] = clip_checked(model.parameters(), 0.25).item()
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-lr)
                diag.step(loss)
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(25))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    assert min(refs.values()) > 0.25  # the clip bit at every step: a post-clip reading would be 0.25
    ratios = points(tmp_path, "diag/update/global_ratio")
    assert set(range(10)) <= set(ratios) and all(0 < v < 1 for v in ratios.values())  # every step at first
    notes = diag.summary()["notes"]
    assert len(notes) == 1 and "no optimizer" in notes[0] and "learning rate" in notes[0]
    assert not diag.alerts


def test_nanogpt_style_clipped_accumulating_adamw_with_warmup(tmp_path) -> None:
    """AdamW with decay/no-decay groups, warm-up then cosine LR set by hand, 4 micro-batches per
    step, clip at 1.0: the pre-clip norm (clip_grad_norm_'s return value) at every optimizer step,
    the clipped norm and coefficient beside it; a healthy run raises nothing."""
    data, vocab = char_data()
    torch.manual_seed(0)
    model = CharGPT(vocab)
    opt = gpt_optimizer(model, 3e-3)
    refs: dict[int, float] = {}
    with one_thread():
        diag = session(model, opt, tmp_path, every=5)
        with diag:
            batches = char_batches(data, 32, 8)
            for it in range(20):
                for g in opt.param_groups:
                    g["lr"] = warmup_cosine(it, 3e-3, 5, 20)
                total = 0.0
                for _ in range(4):
                    x, y = next(batches)
                    _, loss = model(x, y)
                    (loss / 4).backward()
                    total += loss.item() / 4
                refs[it] = clip_checked(model.parameters(), 1.0).item()
                opt.step()
                opt.zero_grad(set_to_none=True)
                diag.step(torch.tensor(total))
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(20))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    coef = points(tmp_path, "diag/grad/clip_coef")
    for step, c in coef.items():
        assert c == pytest.approx(min(1.0, 1.0 / (refs[step] + 1e-6)), rel=1e-4)
    assert points(tmp_path, "diag/opt/lr/0")[0] == pytest.approx(warmup_cosine(0, 3e-3, 5, 20))
    assert [a.kind for a in diag.alerts] == []


def test_lbfgs_closure_reads_the_gradient_at_the_steps_parameters(tmp_path) -> None:
    """LBFGS evaluates its closure several times per step; the recorded norm is the one of the
    first evaluation, at the parameters the step starts from."""
    torch.manual_seed(0)
    x = torch.linspace(-2, 2, 64).unsqueeze(1)
    y = torch.sin(3 * x) + 0.1 * torch.randn_like(x)
    model = nn.Sequential(nn.Linear(1, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    refs = {}
    with one_thread():
        diag = session(model, opt, tmp_path, every=1)
        with diag:
            for step in range(8):
                twin = copy.deepcopy(model)  # the reference: the gradient at this step's parameters
                F.mse_loss(twin(x), y).backward()
                refs[step] = ref_norm(twin.parameters())

                def closure():
                    opt.zero_grad()
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    return loss

                loss = opt.step(closure)
                diag.step(loss)
    got = points(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(8))
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    assert points(tmp_path, "diag/grad/not_zeroed") and max(points(tmp_path, "diag/grad/not_zeroed").values()) == 0.0
    assert not [a for a in diag.alerts if a.kind in ("grads_not_zeroed", "accumulation_reset")]


def test_progressive_unfreezing_follows_new_param_groups(tmp_path) -> None:
    """The optimizer starts with the head; blocks are unfrozen and added with add_param_group at
    steps 8 and 16: the norm covers the optimizer's parameters at every step."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)]
    head = nn.Linear(16, 4)
    model = nn.Sequential(*blocks, head)
    for b in blocks:
        b.requires_grad_(False)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    refs = {}
    with one_thread():
        diag = session(model, opt, tmp_path, every=4)
        with diag:
            for step in range(24):
                if step in (8, 16):
                    b = blocks[1 if step == 8 else 0]
                    b.requires_grad_(True)
                    opt.add_param_group({"params": list(b.parameters()), "lr": 0.01})
                x = torch.randn(32, 16)
                loss = F.cross_entropy(model(x), (x[:, 0] > 0).long())
                loss.backward()
                params = [p for g in opt.param_groups for p in g["params"]]
                refs[step] = clip_checked(params, math.inf).item()
                opt.step()
                opt.zero_grad()
                diag.step(loss)
    got = points(tmp_path, "diag/grad/global_norm")
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    last = [r for r in read_records(tmp_path) if "diag/grad/norm/0.0" in r.scalars]
    assert last and min(r.step for r in last) == 16  # block 0's layer appears once it is trained
    assert not [a for a in diag.alerts if a.kind == "param_not_optimized"]  # frozen on purpose: silent


def test_parameters_in_no_optimizer_are_reported_at_the_first_step(tmp_path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model[2] = nn.Linear(16, 3)  # a head replaced after the optimizer was built
    model[0].requires_grad_(False)  # ...and, separately, a layer frozen on purpose
    with one_thread():
        diag = session(model, opt, tmp_path, every=5)
        with diag:
            for _ in range(6):
                x = torch.randn(16, 8)
                loss = F.cross_entropy(model(x), torch.randint(3, (16,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                diag.step(loss)
    (alert,) = [a for a in diag.alerts if a.kind == "param_not_optimized"]
    assert alert.step == 0 and alert.where == "2 (Linear)" and "51 trainable values" in alert.message
    assert "add_param_group" in alert.hint


def test_per_sample_loss_is_reduced_to_its_mean_with_one_warning(tmp_path, caplog) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), 0.1)
    losses = []
    with caplog.at_level(logging.WARNING, logger="trackdiag"):
        diag = session(model, opt, tmp_path, level="basic", every=5)
        with diag:
            for _ in range(6):
                per_sample = (model(torch.randn(8, 4)).squeeze(1) - 1.0) ** 2  # shape (B,)
                per_sample.mean().backward()
                opt.step()
                opt.zero_grad()
                losses.append(per_sample.mean().item())
                diag.step(per_sample)
    got = points(tmp_path, "diag/loss")
    assert [got[s] for s in range(6)] == pytest.approx(losses, rel=1e-6)
    assert sum("has shape (8,)" in r.message for r in caplog.records) == 1


def test_fp16_parameters_norms_accumulate_in_fp32(tmp_path) -> None:
    """Per-layer norms above ~256 overflow when squares are taken in fp16: measured in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with one_thread():
        diag = session(model, opt, tmp_path, every=1)
        with diag:
            x = torch.randn(32, 64).half()
            model(x).float().mul(50.0).sum().backward()
            per_layer = {n: math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters()))
                         for n, m in model.named_children()}
            total = ref_norm(model.parameters())
            opt.step()
            opt.zero_grad()
            diag.step()
    rec = next(iter(read_records(tmp_path)))
    assert max(per_layer.values()) > 256 * 4  # would be inf with fp16 squares
    for name, ref in per_layer.items():
        assert rec.scalars[f"diag/grad/norm/{name}"] == pytest.approx(ref, rel=1e-3)
    assert points(tmp_path, "diag/grad/global_norm")[0] == pytest.approx(total, rel=1e-3)
    assert rec.scalars["diag/grad/nonfinite_tensors"] == 0


@pytest.mark.parametrize("kind", ["sparse_sgd", "sparse_adam", "complex"])
def test_sparse_and_complex_gradients_keep_the_probe_on(tmp_path, kind: str) -> None:
    torch.manual_seed(0)
    if kind == "complex":
        w = nn.Parameter(torch.randn(6, 3, dtype=torch.complex64))
        model = nn.ParameterDict({"w": w})
        forward = lambda x: (x.to(torch.complex64) @ w).abs().pow(2).mean()  # noqa: E731
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    else:
        model = nn.Embedding(50, 8, sparse=True)
        forward = lambda x: model((x.abs() * 7).long().clamp(max=49)).pow(2).mean()  # noqa: E731
        opt = torch.optim.SGD(model.parameters(), lr=0.1) if kind == "sparse_sgd" else torch.optim.SparseAdam(list(model.parameters()))
    refs = {}
    with one_thread():
        diag = session(model, opt, tmp_path, every=2, probes=quiet_probes(histograms={"enabled": True, "every": 2}))
        with diag:
            for step in range(6):
                forward(torch.randn(16, 6)).backward()
                refs[step] = ref_norm(model.parameters())
                opt.step()
                opt.zero_grad()
                diag.step()
    assert diag.summary()["disabled_probes"] == {}
    got = points(tmp_path, "diag/grad/global_norm")
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-4), step
    assert points(tmp_path, "diag/grad/max_abs")


def test_model_materialised_from_meta_after_the_session(tmp_path) -> None:
    """Built on the meta device, the session made before the weights exist, the optimizer after:
    nothing raises into the user's forward, and the real parameters are measured."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with one_thread():
        diag = session(model, None, tmp_path, every=2)
        model.to_empty(device="cpu")
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        refs = {}
        with diag:
            for step in range(6):
                x = torch.randn(8, 8)
                loss = F.cross_entropy(model(x), torch.randint(2, (8,)))
                loss.backward()
                refs[step] = ref_norm(model.parameters())
                opt.step()
                opt.zero_grad()
                diag.step(loss, batch=(x,))
    assert diag.summary()["disabled_probes"] == {}
    got = points(tmp_path, "diag/grad/global_norm")
    for step, ref in refs.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    assert points(tmp_path, "diag/opt/lr")  # the optimizer made after the session was adopted


def test_dict_of_models_whose_keys_contain_dots(tmp_path) -> None:
    torch.manual_seed(0)
    enc, dec = nn.Linear(4, 8), nn.Linear(8, 2)
    opt = torch.optim.SGD([*enc.parameters(), *dec.parameters()], lr=0.1)
    with one_thread():
        diag = session({"encoder.v2": enc, "": dec}, opt, tmp_path, every=1)
        with diag:
            loss = dec(enc(torch.randn(4, 4))).pow(2).mean()
            loss.backward()
            ref = ref_norm([*enc.parameters(), *dec.parameters()])
            opt.step()
            opt.zero_grad()
            diag.step(loss)
    assert points(tmp_path, "diag/grad/global_norm")[0] == pytest.approx(ref, rel=1e-6)


_LOAD = """
import sys, torch
from torch import nn
sys.modules["trackdiag"] = None  # a process where trackdiag cannot be imported
torch.serialization.add_safe_globals([nn.Sequential, nn.Linear, nn.ReLU, nn.BatchNorm1d])
for path in sys.argv[1:]:
    m = torch.load(path, weights_only=True)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in m.modules())
print("ok", len(sys.argv) - 1)
"""


def test_torch_save_during_a_session_carries_nothing_of_trackdiag(tmp_path) -> None:
    """The word-LM script saves the whole module as its checkpoint: at any point of a session
    (before the first step, mid-window while activations are watched, after a logging step) the
    file loads with weights_only=True in a process without trackdiag."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    saved = []
    with one_thread():
        diag = session(model, opt, tmp_path / "run", level="extreme", every=3,
                       probes=quiet_probes(activations={"every": 3}, nan_replay={"mode": "log"}))
        with diag:
            torch.save(model, tmp_path / "before.pt")
            saved.append(tmp_path / "before.pt")
            for step in range(7):
                x = torch.randn(16, 8)
                loss = F.cross_entropy(model(x), torch.randint(2, (16,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                diag.step(loss, batch=(x,))
                path = tmp_path / f"step{step}.pt"
                torch.save(model, path)
                saved.append(path)
    proc = warm.run([sys.executable, "-c", _LOAD, *map(str, saved)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ok {len(saved)}", proc.stderr[-2000:]


_LOAD_RNN = """
import sys, torch
from torch import nn
sys.modules["trackdiag"] = None  # a process where trackdiag cannot be imported
torch.serialization.add_safe_globals([nn.LSTM, nn.GRU, nn.Embedding, nn.Linear, nn.ModuleDict])
for path in sys.argv[1:]:
    m = torch.load(path, weights_only=True)
    assert not any("_compiled_call_impl" in x.__dict__ or "__getstate__" in x.__dict__ for x in m.modules())
print("ok", len(sys.argv) - 1)
"""


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_rnn_modules_saved_and_copied_mid_session_carry_nothing_and_run_their_own_weights(tmp_path, level) -> None:
    """``nn.LSTM``/``nn.GRU`` keep every attribute in their pickled state (``RNNBase.__getstate__``), so
    trackdiag's call slot on them (the NaN replay's on an RNN model, extreme's per-module flags on every
    module) must be dropped for them: ``torch.save(model)`` of a bare LSTM model and of a model holding a
    GRU loads with ``weights_only=True`` without trackdiag, and a ``copy.deepcopy`` (an EMA or "best"
    copy) runs its own weights, not the original's."""
    torch.manual_seed(0)
    lstm = nn.LSTM(6, 8)  # a component that is an RNN itself: its root call slot
    head = nn.ModuleDict({"emb": nn.Embedding(10, 6), "gru": nn.GRU(6, 8), "out": nn.Linear(16, 3)})
    opts = {"lstm": torch.optim.Adam(lstm.parameters(), 1e-3), "head": torch.optim.Adam(head.parameters(), 1e-3)}
    saved, copies = [], []
    with one_thread():
        diag = session({"lstm": lstm, "head": head}, opts, tmp_path / "run", level=level, every=3)
        with diag:
            for step in range(5):
                tokens = torch.randint(10, (7, 2))
                x = head["emb"](tokens)
                a, _ = lstm(x)
                b, _ = head["gru"](x)
                loss = F.cross_entropy(head["out"](torch.cat([a[-1], b[-1]], 1)), torch.randint(3, (2,)))
                loss.backward()
                for opt in opts.values():
                    opt.step()
                    opt.zero_grad()
                diag.step(loss)
                for name, m in (("lstm", lstm), ("head", head)):
                    torch.save(m, tmp_path / f"{name}{step}.pt")
                    saved.append(tmp_path / f"{name}{step}.pt")
                copies.append((copy.deepcopy(lstm), copy.deepcopy(head["gru"]), x.detach()))
            watched = [m for m in (lstm, head["gru"]) if "_compiled_call_impl" in m.__dict__]
            assert lstm in watched  # the slot is there during the session (the NaN replay watches the root)
            for twin_lstm, twin_gru, x in copies:
                with torch.no_grad():
                    for p in (*twin_lstm.parameters(), *twin_gru.parameters()):
                        p.zero_()
                    assert twin_lstm(x)[0].abs().max() == 0 and twin_gru(x)[0].abs().max() == 0  # its own (zero) weights
                    assert lstm(x)[0].abs().max() > 0
    assert not any("__getstate__" in m.__dict__ for m in (lstm, *head.modules()))  # given back at close
    proc = warm.run([sys.executable, "-c", _LOAD_RNN, *map(str, saved)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ok {len(saved)}", proc.stderr[-2000:]


def test_parametrized_modules_deep_copied_mid_session_run_their_own_weights(tmp_path) -> None:
    """``weight_norm``/``spectral_norm`` (``torch.nn.utils.parametrizations``) give a module class whose own
    ``__deepcopy__`` copies ``__dict__``: a copy made while extreme's per-module flags watch the module
    must run its own weights (the pre-flight's copies got no gradient: a false "parameters get no
    gradient" warning on a healthy run), and the run stays silent."""
    from torch.nn.utils import parametrizations as P

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = P.weight_norm(nn.Linear(8, 16)), P.spectral_norm(nn.Linear(16, 3))

        def forward(self, *, x: torch.Tensor) -> torch.Tensor:  # called with keywords only, as HF models are
            return self.out(torch.tanh(self.inp(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with one_thread():
        diag = session(model, opt, tmp_path / "run", level="extreme", every=3)
        with diag:
            for _ in range(6):
                x, y = torch.randn(8, 8), torch.randint(3, (8,))
                loss = F.cross_entropy(model(x=x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                diag.step(loss, batch=(x, y))
            assert "_compiled_call_impl" in model.inp.__dict__  # watched: the flags' call slot
            twin = copy.deepcopy(model)
            with torch.no_grad():
                for p in twin.parameters():
                    p.add_(0.5)
                assert not torch.allclose(twin(x=x), model(x=x))  # the copy's own (changed) weights
    assert [a for a in diag.alerts if a.severity != "info"] == [], [a.describe() for a in diag.alerts]


def test_no_diagnostic_forward_changes_the_users_model(tmp_path) -> None:
    """extreme's model summary and pre-flight, the activations replay and the NaN replay run extra
    forwards: BatchNorm's batch counter and statistics, and a module's own step counter, are as in
    a bare run."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 16)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x)

    def run(with_diag: bool):
        torch.manual_seed(0)
        model = nn.Sequential(Counting(), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), 0.1)
        diag = session(model, opt, tmp_path / str(with_diag), level="extreme", every=2,
                       probes={"landscape": {"enabled": False}}) if with_diag else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(16, 8, generator=gen)
            y = torch.randint(2, (16,), generator=gen)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if diag is not None:
                diag.step(loss, outputs=None, batch=(x, y))
        if diag is not None:
            diag.close()
        return model

    with one_thread():
        bare, hooked = run(False), run(True)
    assert hooked[0].calls == bare[0].calls == 5
    assert int(hooked[1].num_batches_tracked) == int(bare[1].num_batches_tracked) == 5
    assert torch.equal(hooked[1].running_mean, bare[1].running_mean)
    for a, b in zip(hooked.parameters(), bare.parameters()):
        assert torch.equal(a, b)


def test_odd_module_names_keep_every_probe_on(tmp_path) -> None:
    """Module names ending in ``[x]`` or holding ``\\x1f`` (the old key separator) work for every probe."""

    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleDict({"conv[3]": nn.Linear(8, 16), "act\x1fone": nn.ReLU(), "out[x]": nn.Linear(16, 2)})

        def forward(self, x):
            for m in self.blocks.values():
                x = m(x)
            return x

    torch.manual_seed(0)
    model = Odd()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with one_thread():
        diag = session(model, opt, tmp_path, every=1, probes=quiet_probes(activations={"every": 1}))
        with diag:
            for _ in range(4):
                x = torch.randn(16, 8)
                loss = F.cross_entropy(model(x), torch.randint(2, (16,)))
                loss.backward()
                opt.step()
                opt.zero_grad()
                diag.step(loss, outputs=None, batch=(x,))
    assert diag.summary()["disabled_probes"] == {}
    keys = {k for r in read_records(tmp_path) for k in r.scalars}
    assert "diag/act/dead_fraction/blocks.act\x1fone" in keys
    assert "diag/grad/norm/blocks.conv[3]" in keys and "diag/grad/norm/blocks.out[x]" in keys


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_a_float64_model_with_clipping_and_with_lbfgs(tmp_path, level: str) -> None:
    """pytorch/examples' time_sequence_prediction trains ``seq.double()`` with LBFGS; other scripts clip a
    float64 model's gradients before ``step()``. The wiped-gradient check reads the sentinel's gradient at the
    step when something touched it since the backward pass: an fp32-accumulated norm of an fp64 tensor, which
    torch refuses, switched the ``grads`` probe off for the rest of the run. The pre-clip norm is
    ``clip_grad_norm_``'s return value at every step, and no probe is disabled."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    refs = {}
    with one_thread():
        diag = session(model, opt, tmp_path / "sgd", level=level, every=5)
        with diag:
            for step in range(20):
                x = torch.randn(32, 4, dtype=torch.double)
                out = model(x)
                loss = ((out - x.sum(1, keepdim=True)) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                refs[step] = clip_checked(model.parameters(), 0.5).item()
                opt.step()
                diag.step(loss, outputs=out, batch=(x, None))
    assert diag.summary()["disabled_probes"] == {}
    got = points(tmp_path / "sgd", "diag/grad/global_norm")
    assert sorted(got) == list(range(20)) and all(got[s] == pytest.approx(r, rel=1e-5) for s, r in refs.items())
    assert not [a for a in diag.alerts if a.severity != "info"]

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).double()
    lbfgs = torch.optim.LBFGS(seq.parameters(), lr=0.8)
    x = torch.randn(64, 4, dtype=torch.double)
    y = x.sum(1, keepdim=True)
    with one_thread():
        diag = session(seq, lbfgs, tmp_path / "lbfgs", level=level, every=5)
        with diag:
            for _ in range(8):
                def closure():
                    lbfgs.zero_grad()
                    loss = ((seq(x) - y) ** 2).mean()
                    loss.backward()
                    return loss
                diag.step(lbfgs.step(closure))
    assert diag.summary()["disabled_probes"] == {}
    assert len(points(tmp_path / "lbfgs", "diag/grad/global_norm")) == 8

"""Detectors, second half: memory, data checks, NaN replay, pre-flight. Each fault is planted in a
tiny real training (tests/_zoo_b.py) and every statistic is checked against a reference computed
another way."""
from __future__ import annotations

import contextlib
import copy
import random
import re
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trackdiag
from trackdiag.probes import memory as memory_probe
from trackdiag.core.record import Record
from trackdiag.forensics.replay import replay
from trackdiag.rules.memory import MemoryLeak, linear_fit

from _zoo_b import (Net, batches, digits, kinds, leak_net, log_net, mlp, records, session, slow_loader, train, where_net)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models on a shared 2-core box: intra-op threads only oversubscribe (87 ms vs 2 ms a step)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- data: NaN input, labels
def test_nonfinite_input_exact_step_and_replay_blames_the_data(tmp_path):
    model = log_net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"nan_replay": {"mode": "step"}})

    def plant(step, x, y):
        if step == 13:
            x = x.clone()
            x[5, 7] = float("nan")
        return x, y

    train(diag, model, opt, batches(30), plant=plant)
    got = kinds(diag)
    (inp,) = got["nonfinite_input"]
    assert inp.step == 13 and inp.where == "input batch[0]"  # exact step, the entry of the batch
    loss = got["nonfinite_loss"][0]
    assert loss.step == 13 and loss.where == "body.0 (Linear, input non-finite)", loss
    # reference: which steps really held a NaN, computed on the host
    assert [s for s, (x, _) in enumerate(batches(30)) if not torch.isfinite(plant(s, x, None)[0]).all()] == [13]


def test_nonfinite_input_log_mode_replays_on_the_kept_weights(tmp_path):
    """By the logging step that notices it, Adam has written NaN into every weight; the replay runs
    the bad step's batch on the weights kept at the last finite logging step and finds the input."""
    model = log_net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"nan_replay": {"mode": "log"}})
    train(diag, model, opt, batches(25), plant=lambda s, x, y: (x * float("nan") if s == 13 else x, y))
    loss, inp = kinds(diag)["nonfinite_loss"][0], kinds(diag)["nonfinite_input"][0]
    assert loss.step == 13
    # the replay's account is told once, in the first alert of the incident; the others point to it
    assert loss.where == "body.0 (Linear, input non-finite)" and "replayed on the weights of step 1," in inp.message
    assert loss.message.endswith("NaN replay of step 13: see the nonfinite_input alert of step 13.")
    assert loss.hint.startswith("The NaN/Inf came in with the batch") and "learning rate will not help" in loss.hint
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # reference: they really are NaN now


def test_without_a_weight_snapshot_log_mode_says_params_are_already_nan(tmp_path):
    model = log_net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"nan_replay": {"mode": "log", "snapshot_mb": 0}})
    train(diag, model, opt, batches(25), plant=lambda s, x, y: (x * float("nan") if s == 13 else x, y))
    loss, inp = kinds(diag)["nonfinite_loss"][0], kinds(diag)["nonfinite_input"][0]
    assert loss.step == 13
    assert loss.where == "input batch non-finite (parameters already non-finite)"
    assert "diag.probes.nan_replay.mode=step" in inp.message and "input batch was NON-finite" in inp.message


def _segment(tmp_path, plant, steps=25, **probe):
    """A per-pixel classifier (4 classes) trained as segmentation scripts do: CE with ignore_index=255,
    border pixels void; ``plant(step, y)`` changes the targets. Returns (session, host label stats per step)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    opt = torch.optim.SGD(model.parameters(), 0.05)
    diag = session(model, opt, tmp_path, level="advanced", every=10, probes={"data_labels": probe})
    seen = {}
    with diag:
        for step in range(steps):
            x = torch.rand(2, 3, 12, 12, generator=g)
            y = (x[:, 0] * 3.99).long()
            y[:, :2] = 255
            y = plant(step, y)
            valid = y[(y >= 0) & (y < 4)]
            seen[step] = (int(valid.min()), int(valid.max()))
            out = model(x)
            ok = (y >= 0) & (y < 4)  # what cross_entropy(ignore_index=255) uses; planted labels would crash it
            loss = F.cross_entropy(out.permute(0, 2, 3, 1)[ok], y[ok])
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    return diag, seen


def test_segmentation_void_label_255_is_padding_not_a_label_fault(tmp_path):
    diag, seen = _segment(tmp_path, lambda step, y: y)
    assert "label_range" not in kinds(diag)
    rec = next(r for r in records(tmp_path) if r["step"] == 20)
    assert rec["scalars"]["diag/data/ignore_index"] == 255
    assert rec["scalars"]["diag/data/label_max"] == max(hi for s, (_, hi) in seen.items() if 11 <= s <= 20)


def test_preflight_guesses_the_void_label_of_segmentation_targets(tmp_path):
    """The pre-flight and the replay compute the loss themselves when none is handed over: with VOC/Cityscapes
    targets (void = 255, above the classes) that is cross-entropy with ignore_index=255, as the user's loss does;
    it raised "Target 255 is out of bounds" and the pre-flight was skipped with a note."""
    from trackdiag.util.tensors import default_loss

    g = torch.Generator().manual_seed(0)
    out = torch.randn(2, 4, 6, 6, generator=g)
    y = torch.randint(0, 4, (2, 6, 6), generator=g)
    y[:, 0] = 255
    assert float(default_loss(out, (None, y))) == pytest.approx(float(F.cross_entropy(out, y, ignore_index=255)))
    y[:, 0] = 2
    assert float(default_loss(out, (None, y))) == pytest.approx(float(F.cross_entropy(out, y)))
    with pytest.raises(IndexError):  # one-based labels (the class count itself) are no void label
        default_loss(out, (None, y + 1))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    opt = torch.optim.SGD(model.parameters(), 0.05)
    diag = session(model, opt, tmp_path, level="extreme", probes={"landscape": {"enabled": False}, "report": {"enabled": False}})
    with diag:
        for _ in range(3):
            x = torch.rand(2, 3, 12, 12, generator=g)
            y = (x[:, 0] * 3.99).long()
            y[:, :2] = 255
            out = model(x)
            loss = F.cross_entropy(out, y, ignore_index=255)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    assert not [n for n in diag.summary()["notes"] if "pre-flight" in n], diag.summary()["notes"]
    assert "preflight" not in kinds(diag)


@pytest.mark.parametrize("fault,first", [
    ("one_based", 12),     # labels 1..4 from step 12: the class count itself, never taken as padding
    ("second_void", 15),   # 254 beside 255 from step 15: two values above the classes
    ("configured", 0),     # ignore_index=None: nothing is padding
])
def test_out_of_range_labels_beside_a_void_label_are_still_caught(tmp_path, fault, first):
    def plant(step, y):
        if fault == "one_based" and step >= 12:
            return torch.where(y == 255, y, y + 1)
        if fault == "second_void" and step >= 15:
            y = y.clone()
            y[:, -1] = 254
        return y

    diag, _ = _segment(tmp_path, plant, **({"ignore_index": None} if fault == "configured" else {}))
    (a,) = kinds(diag)["label_range"]
    assert a.step == first and a.severity == "critical", a


def test_label_range_exact_step(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"data_labels": {}}, rules={"label_range": {}})
    shifted = {}

    def plant(step, x, y):
        if step >= 17:  # 1-based labels from here on: 1..10 with 10 classes
            y = y + 1
        shifted[step] = (int(y.min()), int(y.max()))
        return x, y

    def masked_ce(out, y):  # a loss that silently drops what it cannot use (would crash otherwise)
        ok = y < out.shape[1]
        return F.cross_entropy(out[ok], y[ok])

    train(diag, model, opt, batches(25), plant=plant, loss_fn=masked_ce)
    (a,) = kinds(diag)["label_range"]
    assert a.step == 17 and a.value == 10 and a.threshold == 9
    rec = next(r for r in records(tmp_path) if r["step"] == 20)
    window = [shifted[s] for s in range(11, 21)]  # reference: host min/max over the window
    assert rec["scalars"]["diag/data/label_max"] == max(hi for _, hi in window)
    assert rec["scalars"]["diag/data/label_min"] == min(lo for lo, _ in window)
    assert rec["scalars"]["diag/data/label_bad_steps"] == 4 and rec["scalars"]["diag/data/num_classes"] == 10


# ---------------------------------------------------------------- data: loader wait
def _waits(tmp_path):
    rs = [r["scalars"] for r in records(tmp_path) if "diag/data/wait_share" in r["scalars"]]
    return sum(s["diag/data/wait_ms"] * s["diag/data/batches"] for s in rs) / 1e3, sum(s["diag/data/batches"] for s in rs)


def test_data_bottleneck_slow_loader(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"data_wait": {}}, rules={"data_bottleneck": {}})
    train(diag, model, opt, diag.wrap_loader(slow_loader(45, 0.02)))
    (a,) = kinds(diag)["data_bottleneck"]
    assert a.value > 0.5 and a.step in (20, 30)
    wait, n = _waits(tmp_path)
    assert n == 44  # the first batch (worker start-up) is not counted
    assert 0.02 * n <= wait <= 0.02 * n + 0.5  # reference: the sleeps planted in the generator


def test_no_bottleneck_when_only_the_first_batch_is_slow(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=10, probes={"data_wait": {}}, rules={"data_bottleneck": {}})
    loader = diag.wrap_loader(slow_loader(45, 0.0, first_delay=0.5))
    train(diag, model, opt, loader)
    assert "data_bottleneck" not in kinds(diag)
    assert _waits(tmp_path)[0] < 0.2
    plain = [1, 2, 3]
    assert session(model, opt, tmp_path / "b").wrap_loader(plain) is plain  # probe off: the loader itself


# ---------------------------------------------------------------- NaN root cause by replay
def _first_nonfinite_module(net: Net, x: torch.Tensor) -> str:
    """Reference: run the layers one by one (no hooks) and name the first non-finite output."""
    h = x
    with torch.no_grad():
        for i, layer in enumerate(net.body):
            h = layer(h)
            if not torch.isfinite(h).all():
                return f"body.{i}"
    return "head" if not torch.isfinite(net.head(h)).all() else ""


def _saturate(step, x, y):
    return (x * 1e4 if step == 23 else x), y  # the sigmoid saturates to exactly 0, then log(0) = -inf


@pytest.mark.parametrize("mode", ["step", "log+scaler", "log"])
def test_log_of_zero_is_traced_to_the_named_module(tmp_path, mode):
    model = log_net()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu") if mode == "log+scaler" else None  # skips the bad step: params stay finite
    diag = session(model, opt, tmp_path, every=10, probes={"nan_replay": {"mode": mode.split("+")[0]}})
    ref = {}
    train(diag, model, opt, batches(32), plant=_saturate, scaler=scaler,
          before_step=lambda s, x: ref.setdefault("m", _first_nonfinite_module(copy.deepcopy(model), x)) if s == 23 else None)
    a = kinds(diag)["nonfinite_loss"][0]
    assert ref["m"] == "body.2" and a.step == 23
    if mode == "log":  # Adam already wrote NaN into every weight: replayed on the weights kept at step 21
        assert "replayed on the weights of step 21" in a.message, a
    assert a.where == "body.2 (LogLayer, input finite)", a
    assert "LogLayer" in a.message and "from a finite input" in a.message


@pytest.mark.filterwarnings("ignore:Error detected", "ignore:Anomaly Detection")
def test_backward_only_nan_is_traced_to_the_module(tmp_path):
    model = where_net()
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    diag = session(model, opt, tmp_path, every=5, probes={"nan_replay": {"mode": "step"}})
    train(diag, model, opt, batches(3))
    assert "nonfinite_loss" not in kinds(diag)  # the forward is finite
    a = kinds(diag)["nonfinite_grad"][0]
    assert a.step == 0 and a.where == "body.1 (SafeLog, backward)", a
    x, y = next(batches(1))  # reference: anomaly mode names the op inside body.1 (SafeLog)
    with pytest.raises(RuntimeError, match="LogBackward0' returned nan"), torch.autograd.detect_anomaly():
        F.cross_entropy(where_net()(x), y).backward()


class _DrawingNet(nn.Module):
    """A forward that draws from Python's and NumPy's global generators (scheduled sampling's coin, NumPy noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))

    def forward(self, x):
        scale = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return self.body(x * scale)


def _drawing_run(tmp_path, level):
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    model = _DrawingNet()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(12)]
    diag = session(model, opt, tmp_path, level=level, every=5,
                   probes={"landscape": {"enabled": False}, "report": {"enabled": False}}) if level else None
    losses = []
    with diag if diag is not None else contextlib.nullcontext():
        for x, y in data:
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if diag is not None:
                diag.step(loss, outputs=out, batch=(x, y))
            losses.append(loss.item())
    return losses, diag


@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_trackdiags_own_forwards_leave_the_runs_random_draws_alone(tmp_path, level):
    """The pre-flight's trial steps, the replays and the activation sampling call the user's forward again; one that
    draws from ``random`` or ``np.random`` (not only torch's generators, which were kept) saw its later draws shifted
    by trackdiag, so ``extreme`` changed the training trajectory. Same seeds: the same losses to the bit."""
    bare, _ = _drawing_run(tmp_path / "bare", None)
    watched, diag = _drawing_run(tmp_path / level, level)
    assert watched == bare
    assert diag.summary()["steps"] == 12


def test_replay_leaves_no_trace():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Dropout(0.5), nn.ReLU(), nn.Linear(32, 10))
    model[1].eval()  # a mixed-mode model: the flags must come back exactly
    before = copy.deepcopy(model.state_dict())
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    rng = torch.get_rng_state()
    x = digits()[0][:16].clone()
    x[3, 3] = float("inf")
    found = replay(model, [((x,), {}, None)], step=7)
    assert found.phase == "forward" and found.module == "0" and found.input_finite is False
    clean = replay(model, [((digits()[0][:16],), {}, None)], step=8)
    assert clean.phase == "none"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert hooks == [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    assert [m.training for m in model.modules()] == [True, True, False, True, True, True]
    assert all(p.grad is None for p in model.parameters()) and torch.equal(rng, torch.get_rng_state())


# ---------------------------------------------------------------- memory
def test_linear_fit_matches_numpy():
    rng = np.random.default_rng(0)
    xs = np.arange(10.0) * 5
    ys = 3.0 * xs + rng.normal(0, 4, 10)
    slope, r2 = linear_fit(list(xs), list(ys))
    ref = np.polyfit(xs, ys, 1)[0]
    assert slope == pytest.approx(ref) and r2 == pytest.approx(np.corrcoef(xs, ys)[0, 1] ** 2)


@pytest.mark.parametrize("series,fires", [
    ([1000 + 40 * random.Random(i).random() for i in range(12)], False),   # allocator noise
    ([1000 + (i % 3) * 60 for i in range(12)], False),                      # saw-tooth (cache fills/frees)
    ([1000 + 20 * i for i in range(12)], True),                              # a ramp: 20 MB per reading
])
def test_memory_leak_rule_guards(series, fires):
    rule, hist, got = MemoryLeak(), [], []
    for i, v in enumerate(series):
        rec = Record(step=20 + 10 * i, scalars={"diag/mem/rss_mb": v})
        got += rule.check(rec, hist, [])
        hist.append(rec)
    assert bool(got) == fires


def test_memory_leak_from_kept_activations(tmp_path):
    model = leak_net()
    opt = torch.optim.SGD(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=5, probes={"memory": {"every": 5}},
                   rules={"memory_leak": {"action": "stop"}, "memory_pressure": {}})
    keep: list[torch.Tensor] = []
    steps = train(diag, model, opt, batches(120, 256), keep=keep)
    per_step = keep[0].numel() * keep[0].element_size() / 2**20  # reference: 4 MiB kept per step
    keep.clear()
    a = kinds(diag)["memory_leak"][0]  # a leak that keeps growing may be raised again as it worsens
    assert steps < 120 and a.step <= 60 and a.where == "host"  # stopped early: detected within ~40 steps
    pts = [(r["step"], r["scalars"]["diag/mem/rss_mb"]) for r in records(tmp_path) if "diag/mem/rss_mb" in r["scalars"]]
    pts = [p for p in pts if 20 <= p[0] <= a.step][-8:]
    slope = np.polyfit([s for s, _ in pts], [v for _, v in pts], 1)[0]
    said = float(re.search(r"\(([-0-9.]+) MB/step", a.message).group(1))
    assert said == pytest.approx(slope, abs=0.006), (pts, a.message)  # the rule's least-squares fit == numpy's
    # RSS, not allocated bytes: glibc serves the freed 4 MiB pre-ReLU buffers from a heap it cannot
    # always trim between the kept blocks, so RSS grows by 1x-2x what is kept (seen: 4.0 and 8.0 MB/step)
    assert 0.6 * per_step <= slope <= 2.5 * per_step, (slope, per_step)


def test_memory_pressure_host(tmp_path, monkeypatch):
    limits: list[float] = []  # a limit 5% above whatever the RSS is when the probe asks

    def limit() -> float:
        limits.append(memory_probe.rss_bytes() / 0.95)
        return limits[-1]

    monkeypatch.setattr(memory_probe, "memory_limit_bytes", limit)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=5, probes={"memory": {"every": 5}}, rules={"memory_pressure": {}})
    train(diag, model, opt, batches(6))
    a = kinds(diag)["memory_pressure"][0]
    rec = records(tmp_path)[0]["scalars"]
    assert a.where == "host" and a.value > 0.9
    assert rec["diag/mem/rss_frac"] == pytest.approx(rec["diag/mem/rss_mb"] * 2**20 / limits[0], rel=1e-2)


def test_memory_phases_skip_cleanly_on_cpu(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=2, probes={"memory_phases": {"every": 2}})
    train(diag, model, opt, batches(5))
    assert not any("mem/phase" in k for r in records(tmp_path) for k in r["scalars"])
    assert all(not m._forward_hooks for m in model.modules())


def test_memory_phases_hook_schedule_with_a_fake_cuda_counter(tmp_path, monkeypatch):
    """The arming logic on CPU: a fake allocator counter that rises at every read, in phase order."""
    from trackdiag.probes import memory_phases

    reads: list[int] = []
    monkeypatch.setattr(memory_phases, "_cuda_device", lambda comp: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: reads.append(len(reads)) or len(reads) * 2**20)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=3, probes={"memory_phases": {"every": 3}})
    train(diag, model, opt, batches(7))
    phases = {r["step"]: {k.rsplit("/", 1)[1]: v for k, v in r["scalars"].items() if "/mem/phase/" in k} for r in records(tmp_path)}
    assert phases[0] == {"start_mb": 1.0, "forward_mb": 2.0, "backward_mb": 3.0, "step_mb": 4.0}
    assert phases[3] == {"start_mb": 5.0, "forward_mb": 6.0, "backward_mb": 7.0, "step_mb": 8.0}  # nothing read on steps 1, 2
    assert len(reads) == 12 and all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_config_rejects_bad_options():
    with pytest.raises(trackdiag.ConfigError, match="mode"):
        trackdiag.Diagnostics(mlp(), probes={"nan_replay": {"mode": "always"}}, sinks=["local"])
    with pytest.raises(trackdiag.ConfigError) as err:
        trackdiag.Diagnostics(mlp(), rules={"memory_leak": {"min_growth": 1}, "data_bottleneck": {"threshold": "high"}})
    assert len(err.value.problems) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory phases need a GPU")
def test_memory_phases_cuda(tmp_path):
    model = mlp(hidden=1024).cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, every=2, probes={"memory_phases": {"every": 2}})
    train(diag, model, opt, ((x.cuda(), y.cuda()) for x, y in batches(5, 512)))
    rec = next(r["scalars"] for r in records(tmp_path) if r["step"] == 2)
    ph = {k.rsplit("/", 1)[1]: v for k, v in rec.items() if "/mem/phase/" in k}
    assert set(ph) == {"start_mb", "forward_mb", "backward_mb", "step_mb"}
    assert ph["forward_mb"] > ph["start_mb"]  # activations kept for backward
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA memory counters need a GPU")
def test_memory_probe_cuda_counters_are_torch_cuda_s(tmp_path):
    """The memory probe reads the allocator's counters once per logging step (one ``memory_stats``): each value is
    what ``torch.cuda.memory_allocated`` and its siblings say at that moment, and the peak is reset after."""
    from types import SimpleNamespace

    model = mlp(hidden=1024).cuda()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    train(session(model, opt, tmp_path, every=2), model, opt, ((x.cuda(), y.cuda()) for x, y in batches(3, 512)))
    dev = next(model.parameters()).device
    spike = torch.empty(64 * 2**20, dtype=torch.uint8, device=dev)  # a peak above what stays allocated
    del spike
    want = {"cuda_allocated_mb": torch.cuda.memory_allocated(dev) / 2**20,
            "cuda_reserved_mb": torch.cuda.memory_reserved(dev) / 2**20,
            "cuda_peak_mb": torch.cuda.max_memory_allocated(dev) / 2**20,
            "cuda_peak_frac": torch.cuda.max_memory_reserved(dev) / torch.cuda.mem_get_info(dev)[1]}
    ctx = SimpleNamespace(components=[SimpleNamespace(index=SimpleNamespace(params=list(model.parameters())))])
    got = memory_probe.MemoryProbe().collect(ctx)
    assert {k: got[f"diag/mem/{k}"] for k in want} == pytest.approx(want)
    assert want["cuda_peak_mb"] >= want["cuda_allocated_mb"] + 63
    assert torch.cuda.max_memory_allocated(dev) == torch.cuda.memory_allocated(dev)  # reset for the next window


# ---------------------------------------------------------------- pre-flight
class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.lin.weight.detach(), self.lin.bias)  # the weight never learns


def test_preflight_healthy_touches_nothing(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    train(session(model, opt, tmp_path / "warm"), model, opt, batches(3))  # optimizer has state
    state, ostate, rng = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state()
    report = session(model, opt, tmp_path).preflight(next(batches(1)))
    assert report.ok, str(report)
    assert report["overfit"].ok and report["params_change"].ok
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert str(opt.state_dict()) == str(ostate) and torch.equal(rng, torch.get_rng_state())


class Masked(nn.Module):
    """An MLP with a causal-style ``-inf`` mask buffer (as attention models keep) and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()
        self.norm = nn.BatchNorm1d(10)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x)) + self.mask.clamp_min(0).sum()


def test_preflight_finite_state_allows_inf_masks_not_nan_buffers(tmp_path):
    model = Masked()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    report = session(model, opt, tmp_path / "ok").preflight(next(batches(1)))
    assert torch.isinf(model.mask).any() and report["finite_state"].ok, str(report)
    model.norm.running_var[3] = float("inf")  # an infinite running statistic is a fault
    model.net[0].bias.data[0] = float("nan")
    report = session(model, opt, tmp_path / "bad").preflight(next(batches(1)))
    assert not report["finite_state"].ok
    detail = report["finite_state"].detail
    assert detail.startswith("2 parameter/buffer") and "net.0.bias" in detail and "norm.running_var" in detail, detail


def test_preflight_catches_frozen_detached_and_eval(tmp_path):
    model = Net([nn.Linear(64, 32), nn.ReLU(), Detached(), nn.Linear(10, 32)])
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model.body[0].bias.requires_grad_(False)  # frozen after the optimizer got it
    model.eval()
    diag = session(model, opt, tmp_path, rules={"preflight": {"overfit_steps": 0}})
    report = diag.preflight(next(batches(1)))
    failed = {c.name: c.where for c in report.failed}
    # a frozen parameter handed to the optimizer is how a backbone is frozen on purpose: a note, not a fault
    assert failed == {"train_mode": "", "grads": "body.2.lin.weight"}
    assert report["optimizer"].ok is None and "body.0.bias" in report["optimizer"].detail
    assert {a.where for a in diag.alerts} == {"train_mode", "grads:body.2.lin.weight"}
    assert all(a.kind == "preflight" for a in diag.alerts)
    assert model.body[2].lin.weight.grad is None and not model.training  # reference: untouched


class Experts(nn.Module):
    """Top-1 mixture of experts: only the experts some sample is routed to run (``route`` pins the
    choice: expert ``i % 4`` of 8 for sample ``i``, so experts 4-7 never run on a batch)."""

    def __init__(self, detach_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(64, 32)
        self.experts = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(8)])
        self.blocks = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
        self.head = nn.Linear(32, 10)
        self.detach_first = detach_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        route = torch.arange(len(x)) % 4
        out = torch.zeros_like(h)
        for e in route.unique().tolist():
            out[route == e] = self.experts[e](h[route == e])
        h = h + out
        for i, block in enumerate(self.blocks):  # every block runs; the first one's output may be cut
            h = block(h)
            if i == 0 and self.detach_first:
                h = h.detach()
        return self.head(h)


def test_preflight_notes_experts_the_batch_never_called_but_fails_a_called_block_that_was_cut(tmp_path):
    x, y = next(batches(1))
    model = Experts()
    report = session(model, torch.optim.Adam(model.parameters(), 1e-3), tmp_path / "moe").preflight((x, y))
    F.cross_entropy(model(x), y).backward()  # reference: which parameters the user's own pass reaches
    unreached = sorted(n for n, p in model.named_parameters() if p.grad is None)
    assert unreached == sorted(f"experts.{i}.0.{k}" for i in range(4, 8) for k in ("weight", "bias"))
    assert report["grads"].ok is None and "experts.4.0.bias" in report["grads"].detail, str(report)
    assert report.ok and report["params_change"].ok, str(report)
    cut = Experts(detach_first=True)
    diag = session(cut, torch.optim.Adam(cut.parameters(), 1e-3), tmp_path / "cut")
    report = diag.preflight((x, y))
    assert report["grads"].ok is False and report["grads"].where == "inp.weight", str(report)
    assert {a.where for a in diag.alerts} == {"grads:inp.weight"}
    F.cross_entropy(cut(x), y).backward()
    cut_off = [n for n, p in cut.named_parameters() if p.grad is None and not n.startswith(("experts.4", "experts.5", "experts.6", "experts.7"))]
    assert "blocks.0.weight" in cut_off  # a ModuleList entry that ran, cut from the loss: counted, not noted
    assert report["grads"].detail.startswith(f"{len(cut_off)} trainable parameter(s) get no gradient"), report["grads"].detail


class _ZeroGainBlock(nn.Module):
    """A residual block whose last BatchNorm starts at gamma 0 (torchvision's ``zero_init_residual=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        self.c2, self.b2 = nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32)
        nn.init.zeros_(self.b2.weight)

    def forward(self, x):
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


def test_preflight_leaves_a_block_behind_a_zero_initialised_gain_alone(tmp_path):
    """Behind a gain of 0 a block's parameters get a rounding-level gradient (1e-10 and less), which an SGD step
    cannot show in fp32: the pre-flight called them "did not change after an optimizer step" (warning) on a
    healthy ResNet with zero_init_residual. A learning rate of 0 for a group is still caught (the test above)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), _ZeroGainBlock(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    diag = session(model, opt, tmp_path, level="extreme", probes={"landscape": {"enabled": False}, "report": {"enabled": False}})
    with diag:
        for _ in range(2):
            x, y = torch.randn(64, 1, 16, 16, generator=g), torch.randint(0, 4, (64,), generator=g)
            out = model(x)
            loss = F.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(x, y))
    assert not [a for a in diag.alerts if a.kind == "preflight" and "params_change" in a.where], [a.describe() for a in diag.alerts]


def test_preflight_runs_automatically_at_extreme(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model.eval()
    diag = session(model, opt, tmp_path, level="extreme", probes={"landscape": {"enabled": False}, "report": {"enabled": False}})
    train(diag, model, opt, batches(2))
    a = kinds(diag)["preflight"]
    assert [x.where for x in a] == ["train_mode"] and a[0].step == 0


def test_auto_preflight_reads_the_steps_loss_without_a_torch_warning(tmp_path):
    """The loss handed to step() still requires grad (most loops pass it as is): the pre-flight's one
    read of it must not make torch print "Converting a tensor with requires_grad=True to a scalar"
    into the user's console."""
    import warnings

    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, level="extreme", probes={"landscape": {"enabled": False}, "report": {"enabled": False}})
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(diag, model, opt, batches(2))
    assert not [str(w.message) for w in seen if "requires_grad" in str(w.message)]
    assert diag.summary()["steps"] == 2


# ---------------------------------------------------------------- a healthy run fires nothing
def test_healthy_run_at_advanced_is_silent(tmp_path):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = digits()
    xva, yva = x[-300:], y[-300:]
    diag = session(model, opt, tmp_path, level="advanced", probes={"report": {"enabled": False}})
    data = list(batches(300))
    with diag:
        for step, (xb, yb) in enumerate(diag.wrap_loader(data)):
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out, batch=(xb, yb))
            if (step + 1) % 50 == 0:
                with torch.no_grad():
                    diag.log_eval(loss=F.cross_entropy(model(xva), yva).item())
    assert diag.summary()["steps"] == 300 and diag.alerts == [], [a.describe() for a in diag.alerts]
    recs = [r["scalars"] for r in records(tmp_path)]
    # the detectors did look: references from the data itself
    assert max(r["diag/data/label_max"] for r in recs if "diag/data/label_max" in r) == int(torch.cat([b[1] for b in data]).max())
    assert {r["diag/data/num_classes"] for r in recs if "diag/data/num_classes" in r} == {10.0}
    assert {r["diag/data/nonfinite_first_step"] for r in recs if "diag/data/nonfinite_first_step" in r} == {-1.0}
    assert sum(r.get("diag/data/batches", 0) for r in recs) == 299  # every fetch but the first
    assert all(r["diag/data/wait_share"] < 0.5 for r in recs if "diag/data/wait_share" in r)
    assert sum(1 for r in recs if "diag/mem/rss_mb" in r) >= 6 and all(0 < r["diag/mem/rss_frac"] < 1 for r in recs if "diag/mem/rss_frac" in r)


def test_hooked_model_deepcopies_and_pickles_without_the_session(tmp_path):
    import pickle

    from trackdiag.forensics.preflight import clone_model

    model = mlp()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    diag = session(model, opt, tmp_path, probes={"nan_replay": {}})
    model.register_forward_hook(diag.step)  # a foreign-style trackdiag hook (bound to the session, not copyable)
    with pytest.raises(TypeError):
        copy.deepcopy(model)
    clone = clone_model(model)
    clone(digits()[0][:4])  # the hooks are no-ops in the clone: the session sees nothing
    assert diag.global_step == 0
    model._forward_hooks.clear()
    assert isinstance(pickle.loads(pickle.dumps(model)), nn.Sequential)  # SafeHook pickles as a no-op: no session inside
    diag.close()


def test_preflight_overfit_fails_with_a_learning_rate_far_too_small(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 1e-7)
    report = session(model, opt, tmp_path).preflight(next(batches(1)))
    assert [c.name for c in report.failed] == ["overfit"]
    first, last = _fit_by_hand(model, 1e-7, next(batches(1)))  # reference: the same 30 steps by hand on a copy
    assert f"from {first:.4g} to {last:.4g}" in report["overfit"].detail


def _fit_by_hand(model: nn.Module, lr: float, batch, steps: int = 30) -> tuple[float, float]:
    """The pre-flight's one-batch fit, by hand on a copy with SGD: (first loss, the median loss of the last
    quarter of the steps)."""
    clone = copy.deepcopy(model)
    o = torch.optim.SGD(clone.parameters(), lr)
    x, y = batch
    first = F.cross_entropy(clone(x), y).item()
    losses = []
    for _ in range(steps):
        o.zero_grad()
        loss = F.cross_entropy(clone(x), y)
        loss.backward()
        o.step()
        losses.append(loss.item())
    return first, statistics.median(losses[-(steps // 4):])


def test_preflight_overfit_slow_learning_rate_is_a_note_not_an_alert(tmp_path):
    """Plain SGD at a modest learning rate lowers the loss, just not by 10 % in 30 steps: no false alarm,
    while the reference run by hand shows the loss did fall by less than asked."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), 0.02)
    x, y = next(batches(1))
    report = session(model, opt, tmp_path).preflight((x, y))
    first, last = _fit_by_hand(model, 0.02, (x, y))
    assert 0.01 * first < first - last < 0.1 * first  # fell, but by less than the 10 % asked
    assert report.ok and report["overfit"].ok is None and "slower" in report["overfit"].detail

"""The global gradient norm equals clip_grad_norm_'s return value on the same gradients."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import trackdiag
from trackdiag.core.record import read_records
from conftest import LEAN_PROBES, batches, make_mlp
from _clip import clip_checked


def _series(out_dir, key: str) -> dict[int, float]:
    """Every (step, value) point of ``key`` in the local record (scalars and every-step series)."""
    return {s: v for r in read_records(out_dir) for k, s, v in r.points() if k == key}


@pytest.mark.parametrize("every", [1, 7])
@pytest.mark.parametrize("mode", ["plain", "scaler_explicit_unscale", "scaler_implicit_unscale", "accumulate", "clipped"])
@pytest.mark.parametrize("hidden", [32, 300])
def test_global_grad_norm_matches_clip_grad_norm(digits, tmp_path, mode: str, every: int, hidden: int) -> None:
    """``every=7``: off the due steps a step's norm is kept as its per-tensor norms and worked out for the
    whole window at the logging step (:func:`trackdiag.capture.grad_records.totals`); every step still matches.
    ``hidden=300``: a 90,000-value weight, which the CPU measures by the same one ``_foreach_norm`` (few tensors,
    whatever their size: ``LayerIndex.foreach``)."""
    x, y = digits
    model = make_mlp(hidden=hidden)
    assert max(p.numel() for p in model.parameters()) == {32: 2048, 300: 90_000}[hidden]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if mode.startswith("scaler") else None
    diag = trackdiag.Diagnostics(model, opt, scaler, level="advanced", every=every, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES)
    assert diag.components[0].index.foreach  # one _foreach_norm a pass, large tensors too
    expected: dict[int, float] = {}
    data = batches(x, y)
    micro = 3 if mode == "accumulate" else 1
    with diag:
        for step in range(12):
            for _ in range(micro):
                xb, yb = next(data)
                loss = F.cross_entropy(model(xb), yb) / micro
                (scaler.scale(loss) if scaler else loss).backward()
            if mode == "scaler_explicit_unscale":
                scaler.unscale_(opt)
            if mode == "scaler_implicit_unscale":
                # reference on a copy of the unscaled grads; scaler.step unscales itself before optimizer.step
                grads = [p.grad.detach().clone() / scaler.get_scale() for p in model.parameters()]
                expected[step] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
            elif mode == "clipped":  # the pre-clip norm: what clip_grad_norm_ returns
                expected[step] = clip_checked(model.parameters(), 0.1).item()
            else:
                expected[step] = clip_checked(model.parameters(), math.inf).item()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            diag.step(loss)
    got = _series(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == list(range(12))
    for step, ref in expected.items():
        assert got[step] == pytest.approx(ref, rel=1e-5), step
    if mode == "clipped" and every == 1:  # the clipped norm and the coefficient beside it (due-step values)
        clipped = _series(tmp_path, "diag/grad/clipped_norm")
        coef = _series(tmp_path, "diag/grad/clip_coef")
        assert sorted(clipped) == sorted(coef) == list(range(12))
        assert sum(ref > 0.1 for ref in expected.values()) >= 6  # the clip did bite
        for step, ref in expected.items():
            assert clipped[step] == pytest.approx(min(ref, 0.1), rel=1e-4)
            assert coef[step] == pytest.approx(min(1.0, 0.1 / ref), rel=1e-4)


def test_per_layer_norms_and_max_abs_match_direct_computation(digits, tmp_path) -> None:
    x, y = digits
    model = make_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    diag = trackdiag.Diagnostics(model, opt, level="advanced", every=1, sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES)
    refs = []
    with diag:
        for step, (xb, yb) in zip(range(3), batches(x, y)):
            F.cross_entropy(model(xb), yb).backward()
            per_layer = {}
            for name, mod in model.named_children():
                ps = [p.grad for p in mod.parameters()]
                if ps:
                    per_layer[name] = torch.sqrt(sum((g.double() ** 2).sum() for g in ps)).item()
            max_abs = max(p.grad.abs().max().item() for p in model.parameters())
            refs.append((per_layer, max_abs))
            opt.step()
            opt.zero_grad()
            diag.step()
    records = list(read_records(tmp_path))
    for rec, (per_layer, max_abs) in zip(records, refs):
        for layer, v in per_layer.items():
            assert rec.scalars[f"diag/grad/norm/{layer}"] == pytest.approx(v, rel=1e-5)
        assert rec.scalars["diag/grad/max_abs"] == pytest.approx(max_abs, rel=1e-6)
        assert rec.scalars["diag/grad/nonfinite_tensors"] == 0


def test_named_components_gan_style(tmp_path) -> None:
    """Dicts of models/optimizers: every statistic is keyed by component name."""
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    d = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    og, od = torch.optim.Adam(g.parameters(), 1e-3), torch.optim.Adam(d.parameters(), 1e-3)
    diag = trackdiag.Diagnostics({"G": g, "D": d}, {"G": og, "D": od}, level="advanced", every=1,
                                 sinks=["local"], output_dir=str(tmp_path), probes=LEAN_PROBES)
    refs: dict[str, list[float]] = {"G": [], "D": []}
    with diag:
        for _ in range(4):
            z, real = torch.randn(16, 4), torch.randn(16, 8)
            ld = F.softplus(-d(real)).mean() + F.softplus(d(g(z).detach())).mean()
            ld.backward()
            refs["D"].append(clip_checked(d.parameters(), math.inf).item())
            od.step()
            od.zero_grad()
            lg = F.softplus(-d(g(z))).mean()
            lg.backward()
            refs["G"].append(clip_checked(g.parameters(), math.inf).item())
            og.step()
            og.zero_grad()
            d.zero_grad()
            diag.step({"G": lg, "D": ld})
    records = list(read_records(tmp_path))
    for name in ("G", "D"):
        got = [v for _, v in sorted(_series(tmp_path, f"diag/{name}/grad/global_norm").items())]
        assert got == pytest.approx(refs[name], rel=1e-5)
        series = [p for r in records for p in r.series.get(f"diag/{name}/loss", [])]
        assert [s for s, _ in series] == [0, 1, 2, 3]
    assert "diag/grad/global_norm" not in records[0].series


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_one_model_two_optimizers_each_after_its_own_backward(tmp_path, level: str) -> None:
    """DDPG/SAC-style, in one module: the critic's backward and step, then the actor's. The step's global norm
    is the norm of each part's gradient at its own optimizer's step (the actor's pass merged in at its step:
    before, the actor's previous-step gradient was counted and the actor looked untrained), and so is every
    layer's norm at the logging steps."""
    torch.manual_seed(0)
    agent = torch.nn.ModuleDict({"critic": torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)),
                                 "actor": torch.nn.Sequential(torch.nn.Linear(4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))})
    oc, oa = torch.optim.Adam(agent["critic"].parameters(), 1e-3), torch.optim.Adam(agent["actor"].parameters(), 1e-3)
    diag = trackdiag.Diagnostics(agent, {"critic": oc, "actor": oa}, level=level, every=5, sinks=["local"],
                                 output_dir=str(tmp_path), probes=LEAN_PROBES)
    ref, layers = [], []
    layer_norm = lambda m: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in m.parameters()))  # noqa: E731
    with diag:
        for _ in range(60):
            s = torch.randn(64, 4)
            critic_loss = F.mse_loss(agent["critic"](s), s.sum(1, keepdim=True))
            oc.zero_grad()
            critic_loss.backward()
            nc = clip_checked(agent["critic"].parameters(), math.inf).item()
            at = {f"critic.{i}": layer_norm(agent["critic"][i]) for i in (0, 2)}
            oc.step()
            actor_loss = -(agent["actor"](s) * s[:, :2]).mean()
            oa.zero_grad()
            actor_loss.backward()
            na = clip_checked(agent["actor"].parameters(), math.inf).item()
            at.update({f"actor.{i}": layer_norm(agent["actor"][i]) for i in (0, 2)})
            oa.step()
            ref.append(math.hypot(nc, na))
            layers.append(at)
            diag.step(critic_loss + actor_loss)
    got = [v for _, v in sorted(_series(tmp_path, "diag/grad/global_norm").items())]
    assert got == pytest.approx(ref, rel=1e-5)
    assert not [a for a in diag.alerts if a.kind == "stale_params"], diag.alerts
    if level == "advanced":
        for name in ("critic.0", "critic.2", "actor.0", "actor.2"):
            logged = _series(tmp_path, f"diag/grad/norm/{name}")
            assert len(logged) >= 10 and all(v == pytest.approx(layers[step][name], rel=1e-5) for step, v in logged.items()), name


def test_many_tensors_take_the_chunked_paths_and_still_match(tmp_path) -> None:
    """A model of 120 parameter tensors (the many-tensor paths of ``max_abs`` and the histogram
    binning on CPU, and chunks smaller than the model): global norm vs ``clip_grad_norm_``, max |g|
    vs a direct reduction, NaN still counted."""
    import trackdiag.util.norms as norms

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(60)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    refs = []
    old_chunk, norms.CHUNK = norms.CHUNK, 5000  # several chunks in this small model
    try:
        with trackdiag.Diagnostics(model, opt, level="basic", every=1, sinks=["local"], output_dir=str(tmp_path)) as diag:
            for step in range(3):
                model(torch.randn(8, 16)).square().mean().backward()
                total = clip_checked(model.parameters(), math.inf).item()
                refs.append((total, max(p.grad.abs().max().item() for p in model.parameters())))
                if step == 2:  # after clip_grad_norm_, which would spread the NaN to every tensor
                    model[30].weight.grad[0, 0] = float("nan")
                opt.step()
                opt.zero_grad()
                diag.step()
    finally:
        norms.CHUNK = old_chunk
    records = list(read_records(tmp_path))
    norms = _series(tmp_path, "diag/grad/global_norm")
    for rec, (total, top) in zip(records[:2], refs[:2]):
        assert norms[rec.step] == pytest.approx(total, rel=1e-5)
        assert rec.scalars["diag/grad/max_abs"] == pytest.approx(top, rel=1e-6)
    # the NaN was written after the backward pass: the pre-clip norm is still the finite one, but the
    # gradients the optimizer used hold it
    assert norms[2] == pytest.approx(refs[2][0], rel=1e-5)
    assert records[2].scalars["diag/grad/nonfinite_tensors"] == 1


def test_no_gradient_or_output_outlives_its_step(tmp_path) -> None:
    """What the probes share within an optimizer hook (the gradient list, norms) and what ``step``
    is given (outputs, with their graph) must be gone once the user drops them: weak references die."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with trackdiag.Diagnostics(model, opt, level="advanced", every=1, sinks=["local"], output_dir=str(tmp_path)) as diag:
        out = model(torch.randn(32, 8))
        loss = out.square().mean()
        loss.backward()
        grads = [weakref.ref(p.grad) for p in model.parameters()]
        opt.step()
        diag.step(loss, outputs=out, batch=torch.randn(32, 8))
        kept = weakref.ref(out)  # the tensor carries the graph (grad_fn)
        opt.zero_grad(set_to_none=True)
        del out, loss
        gc.collect()
        assert all(g() is None for g in grads), "a gradient is kept alive past zero_grad"
        assert kept() is None, "the step's outputs (and their graph) are kept alive"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_agrees_with_isfinite_and_leaves_values_bitwise_unchanged(dtype) -> None:
    """``all_finite`` (GradScaler's check kernel at scale 1) vs ``torch.isfinite`` per tensor, over lists
    with one NaN, +Inf or -Inf planted anywhere, with 0-d, empty, transposed and mixed-dtype tensors;
    the checked tensors keep every bit (subnormals, -0.0, NaN) and their version counter."""
    from trackdiag.util.norms import all_finite

    gen = torch.Generator().manual_seed(0)
    tiny = torch.finfo(dtype).tiny / 4  # a subnormal
    outcomes = set()
    for trial in range(12):
        ts = [torch.randn(5, 7, generator=gen).to(dtype).t(), torch.randn((), generator=gen).to(dtype),
              torch.empty(0, dtype=dtype), torch.tensor([tiny, -0.0, 1e4], dtype=dtype),
              torch.randn(300, generator=gen).double()]
        ts += [torch.randn(int(n), generator=gen).to(dtype) for n in torch.randint(1, 50, (20,), generator=gen)]
        if trial % 3:
            victim = ts[int(torch.randint(0, len(ts), (1,), generator=gen))]
            if victim.numel():
                k = torch.randint(0, victim.numel(), (), generator=gen)
                victim[torch.unravel_index(k, victim.shape)] = [math.nan, math.inf, -math.inf][trial % 3]
        before = [(_bits(t), t._version) for t in ts]
        expected = all(bool(torch.isfinite(t).all()) for t in ts)
        got = all_finite(ts)
        assert got.dtype == torch.bool and got.dim() == 0 and bool(got) == expected, trial
        outcomes.add(expected)
        for t, (bits, version) in zip(ts, before):
            assert torch.equal(_bits(t), bits) and t._version == version
    assert outcomes == {True, False}


def test_all_finite_falls_back_where_the_kernel_refuses() -> None:
    """Expanded (overlapping) views and complex tensors take the norm path and still answer right."""
    from trackdiag.util.norms import all_finite

    row = torch.tensor([1.0, 2.0, math.nan])
    assert not bool(all_finite([torch.ones(3), row[:2].expand(4, 2).t()] + [row.expand(2, 3)]))
    assert bool(all_finite([row[:2].expand(3, 2)]))
    assert bool(all_finite([torch.randn(4, dtype=torch.complex64)]))
    assert not bool(all_finite([torch.tensor([1 + 1j, complex(math.inf, 0)])]))
    assert bool(all_finite([]))


def test_global_norm_of_small_and_large_cpu_tensors_matches_float64() -> None:
    """The CPU path that norms the small tensors as concatenated chunks, the mid-sized ones by the
    foreach kernel and the large contiguous fp32/fp64 ones by BLAS dots gives the same number as a
    float64 reference (each path alone, and together); non-contiguous large tensors take the
    foreach kernel."""
    from trackdiag.util.norms import DOT, SMALL, global_norm

    gen = torch.Generator().manual_seed(3)
    small = [torch.randn(int(n), generator=gen) for n in torch.randint(1, SMALL, (300,), generator=gen)]
    mid = [torch.randn(SMALL + 17, generator=gen) * 3 for _ in range(5)]
    big = [torch.randn(DOT + 5, generator=gen) * 1e-3, torch.randn(700, 300, generator=gen).t(),  # a transposed view
           torch.randn(2 * DOT, dtype=torch.float64, generator=gen) * 1e4, torch.randn(4_000_000, generator=gen)]
    for tensors in (small + mid, small, mid * 20, mid[:2], big, big[:1], small + mid + big):
        ref = torch.cat([t.double().flatten() for t in tensors]).norm()
        got = global_norm(tensors)
        assert got.dtype == torch.float32 and got.dim() == 0
        assert float(got) == pytest.approx(float(ref), rel=2e-5)


def test_totals_of_mixed_passes_keep_their_order() -> None:
    """Passes of different sizes, some worked out already, some under a scale: one tensor in order."""
    from trackdiag.capture.grad_records import totals

    g = torch.Generator().manual_seed(0)
    grads = [[torch.randn(n, generator=g) for n in sizes] for sizes in ([3, 4], [5], [3, 4], [2, 2, 2], [5])]
    ref = [math.sqrt(sum(float(t.square().sum()) for t in gs)) for gs in grads]
    scale = torch.tensor(4.0)
    items = [
        (torch._foreach_norm(grads[0]), None),
        torch.tensor(ref[1]),                                   # already worked out
        ([t * 4.0 for t in torch._foreach_norm(grads[2])], scale),  # scaled parts: divided back
        (torch._foreach_norm(grads[3]), None),
        (torch._foreach_norm(grads[4]), None),
    ]
    out = totals(items)
    assert out.shape == (5,) and out.dtype == torch.float32
    assert out.tolist() == pytest.approx(ref, rel=1e-6)


def test_one_hook_per_builtin_layer_still_sees_every_pass_that_reaches_the_component(tmp_path) -> None:
    """The tap hooks one parameter per built-in layer (its forward uses them all) but every parameter of
    anything else: a pass that reaches only a custom module's second tensor is still measured, and its
    norm equals the direct one."""
    from trackdiag.capture.gradtap import firing

    class Two(torch.nn.Module):  # two tensors a pass can reach one at a time
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))

    emb = torch.nn.Embedding(5, 3)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(3, 3), "gru": torch.nn.GRU(3, 3), "two": Two(), "emb": emb})
    model["tied"] = torch.nn.Linear(3, 5)
    model["tied"].weight = emb.weight  # weight tying: one tensor in two layers
    params = list(model.parameters())
    fire = firing(model, params, sentinel=model["lin"].bias)
    named = {n for n, p in model.named_parameters() if id(p) in fire}
    assert named == {"lin.bias", "gru.weight_ih_l0", "two.a", "two.b", "emb.weight"}, named

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diag = trackdiag.Diagnostics(model, opt, level="basic", every=1, sinks=["local"], output_dir=str(tmp_path),
                                 probes=LEAN_PROBES)
    expected = {}
    with diag:
        for step in range(3):
            (model["two"].b * torch.arange(1.0, 4.0)).sum().backward()  # reaches only two.b (hooked: not a built-in)
            # the pre-clip norm is the tap's (a pass it missed would be read at the step: the clipped 1e-3)
            expected[step] = clip_checked(model.parameters(), 1e-3).item()
            opt.step()
            opt.zero_grad(set_to_none=True)
            diag.step()
    got = _series(tmp_path, "diag/grad/global_norm")
    assert sorted(got) == [0, 1, 2]
    for step, ref in expected.items():
        assert ref == pytest.approx(math.sqrt(14.0)) and got[step] == pytest.approx(ref, rel=1e-5), step

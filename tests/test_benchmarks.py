"""The overhead benchmark as an instrument: it runs (eager and ``--compile``), its table has the arms
and finite ratios, the Cockpit arm really computes Cockpit's quantities, the scaling workloads have
the tensor counts they claim, and ``--device cuda`` refuses to stand in CPU numbers.

The ``cuda`` tests are the GPU story that scripts/gpu_check.sh runs on a machine with a GPU: the
benchmark on CUDA (compiled, bf16 and fp16 + GradScaler), trackdiag sessions under autocast with a
GradScaler (a planted overflow is seen as one skipped step), and the CUDA memory snapshot.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import _warm as warm

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HAS_COCKPIT = all(importlib.util.find_spec(m) is not None for m in ("cockpit", "backpack"))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _overhead(tmp_path: Path, *args: str, timeout: int = 240) -> tuple[dict, str]:
    """Run benchmarks/overhead.py in a fresh process (Dynamo state and sys.path stay out of this one)."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = warm.run([sys.executable, str(BENCH / "overhead.py"), *args, "--json", str(out)], capture_output=True, text=True,
                    timeout=timeout, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _finite(row: dict) -> bool:
    return all(isinstance(row.get(k), float) and math.isfinite(row[k]) and row[k] > 0 for k in ("ms", "ratio", "cpu_ratio"))


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import cockpit_arm
        import gpt
        import workloads

        yield workloads, gpt, cockpit_arm
    finally:
        sys.path.remove(str(BENCH))


def test_scaling_workloads_have_their_tensor_counts_at_constant_flops(bench_modules) -> None:
    workloads, _, _ = bench_modules
    flops = []
    for t in (10, 100, 1000, 3000):
        model = workloads.get(f"scale{t}").make_model()
        params = list(model.parameters())
        assert len(params) == t
        flops.append(sum(p.numel() for p in params if p.dim() == 2))  # multiply-adds per sample
    assert max(flops) / min(flops) < 1.05, flops
    with pytest.raises(ValueError, match="even"):
        workloads.scale_workload(7)


def test_gpt_is_about_100m_parameters_and_tiny_twin_trains(bench_modules) -> None:
    workloads, gpt, _ = bench_modules
    with torch.device("meta"):
        big = gpt.GPT_WORKLOADS["gpt"].make_model()
    assert 90e6 < sum(p.numel() for p in big.parameters()) < 130e6  # tied head counted once
    wl = gpt.GPT_WORKLOADS["gpt_tiny"]
    assert wl.amp == torch.bfloat16 and gpt.GPT_WORKLOADS["gpt"].cuda_only
    torch.manual_seed(0)
    model, g = wl.make_model(), torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        x, y = wl.make_batch(g)
        loss = wl.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not HAS_COCKPIT, reason="Cockpit/BackPACK not installed (bash scripts/bench_setup.sh)")
def test_cockpit_support_check_names_backpacks_gaps(bench_modules) -> None:
    workloads, gpt, cockpit_arm = bench_modules
    assert cockpit_arm.unsupported(workloads.get("mlp").make_model()) is None
    assert cockpit_arm.unsupported(workloads.get("scale100").make_model()) is None
    assert "no LayerNorm" in cockpit_arm.unsupported(gpt.GPT_WORKLOADS["gpt_tiny"].make_model())
    why = cockpit_arm.unsupported(workloads.get("transformer").make_model())
    assert "MultiheadAttention" in why and "TinyLM" in why  # the functionally used in_proj and pos
    assert "torch.compile" in cockpit_arm.unsupported(workloads.get("mlp").make_model(), compiled=True)


def test_device_cuda_without_a_gpu_fails_loudly(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only machine's refusal")
    proc = warm.run([sys.executable, str(BENCH / "overhead.py"), "--device", "cuda", "--workloads", "gpt_tiny"],
                    capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "cuda" in proc.stderr.lower() and "ms/step" not in proc.stdout


@pytest.mark.slow
def test_overhead_eager_table_with_cockpit_arm(tmp_path: Path) -> None:
    """Eager run: every arm has finite ratios; the Cockpit arm logs its economy quantities where
    BackPACK supports the model and is skipped with BackPACK's reason where it does not."""
    arms = ["disabled", "basic", "advanced", "extreme", *(["cockpit"] if HAS_COCKPIT else [])]
    res, stdout = _overhead(tmp_path, "--workloads", "cnn", "gpt_tiny", "--arms", *arms,
                            "--rounds", "2", "--steps", "5", "--warmup", "5", "--markdown")
    rows = {(r["workload"], r["arm"]): r for r in res["rows"]}
    for wl in ("cnn", "gpt_tiny"):
        for arm in ["bare", "disabled", "basic", "advanced", "extreme"]:
            assert _finite(rows[(wl, arm)]), rows[(wl, arm)]
        assert math.isfinite(rows[(wl, "basic")]["attributed"])
    assert "| cnn | extreme |" in stdout and "wall ratio (95 %)" in stdout
    if not HAS_COCKPIT:
        pytest.skip("Cockpit/BackPACK not installed (bash scripts/bench_setup.sh): the Cockpit arm is unchecked")
    cp = rows[("cnn", "cockpit")]
    assert _finite(cp) and cp["ratio"] > 1.0
    assert {"Alpha", "GradNorm", "GradHist1d", "NormTest", "Loss"} <= set(cp["cockpit_quantities"])  # really Cockpit's economy
    assert ("gpt_tiny", "cockpit") not in rows and any("gpt_tiny / cockpit: BackPACK has no LayerNorm" in s for s in res["skipped"])


def test_flight_recorder_arms_and_benchmark(tmp_path: Path) -> None:
    """The flight recorder's cost is measurable: ``<preset>+modules`` / ``+nomodules`` arms in the
    overhead benchmark, and benchmarks/flight.py's table (flags per module call, crash path)."""
    res, _ = _overhead(tmp_path, "--workloads", "small", "--arms", "advanced+modules", "extreme+nomodules",
                       "--rounds", "1", "--steps", "10", "--warmup", "5")
    rows = {r["arm"]: r for r in res["rows"]}
    assert _finite(rows["advanced+modules"]) and _finite(rows["extreme+nomodules"]), rows
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = warm.run([sys.executable, str(BENCH / "flight.py"), "--workloads", "small", "--rounds", "2", "--steps", "3"],
                    capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| small |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 10 and all(math.isfinite(float(c.rstrip(" %"))) for c in cells[1:]), row


@pytest.mark.slow
def test_probe_costs_times_each_part_as_often_as_the_loop_calls_it(tmp_path: Path) -> None:
    """benchmarks/probe_costs.py on the small MLP at advanced (logs every 10 steps, one optimizer): per step,
    one ``Diagnostics.step`` and one end-of-backward tap, a pre- and a post-step dispatch, a logging step every
    10th, the grads probe's ``on_grads`` once; the parts inside a whole cost less than it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = warm.run([sys.executable, str(BENCH / "probe_costs.py"), "--workload", "small", "--arm", "advanced",
                           "--steps", "100", "--top", "60"], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[1].replace(".", "").isdigit():
            rows[cells[0]] = (float(cells[1]), float(cells[2]))
    calls = {k: c for k, (_, c) in rows.items()}
    assert calls["Diagnostics.step"] == 1.0 and calls["end-of-backward tap (gradient norms)"] == 1.0
    assert calls["optimizer dispatch"] == 2.0 and calls["logging step (all of it)"] == 0.1
    assert calls["probe grads.on_grads"] == 1.0 and calls["probe loss.on_step"] == 1.0
    spent = {k: us for k, (us, _) in rows.items()}
    assert 0 < spent["logging step: rules"] < spent["logging step (all of it)"] < spent["Diagnostics.step"]
    assert spent["probe grads.on_grads"] < spent["optimizer dispatch"]
    ratio = re.search(r"\(x(\d+\.\d+)\)", proc.stdout.splitlines()[0])  # the header's ratio to the bare arm
    assert ratio is not None and float(ratio.group(1)) > 1.0  # (its size depends on the machine's load)


def test_floor_table_has_the_floor_the_machinery_and_each_preset(tmp_path: Path) -> None:
    """benchmarks/floor.py on the small MLP: a row per arm (the bare loop at +0, the hand-written floor, the session's
    machinery, the presets, a preset without a probe), each a finite time; ``advanced``, whose first steps are all
    logging steps, above the bare loop; an unknown probe name is refused with the preset's probes listed."""
    from trackdiag.core.presets import load_preset

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(BENCH / "floor.py"), "--rounds", "2", "--steps", "10", "--warmup", "5"]
    proc = warm.run([*cmd, "--drop", "basic:data_finite"], capture_output=True, text=True, timeout=240, env=env,
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[1].replace(".", "").isdigit():
            rows[cells[0]] = (float(cells[1]), float(cells[2]), float(cells[3]))
    assert set(rows) == {"bare", "floor", "fused", "machinery", "basic", "advanced", "basic without data_finite"}, proc.stdout
    assert rows["bare"][1:] == (0.0, 1.0) and all(math.isfinite(v) and v > 0 for v, _, _ in rows.values())
    assert rows["advanced"][2] > 1.0, proc.stdout
    sys.path.insert(0, str(BENCH))
    try:
        import floor
    finally:
        sys.path.remove(str(BENCH))
    with pytest.raises(SystemExit, match=r"no probe \['no_such_probe'\] in 'basic': .*data_finite"):
        floor.probes_off("basic", drop={"no_such_probe"})
    assert floor.probes_off("basic", keep={"loss"}).keys() == set(load_preset("basic")["probes"]) - {"loss"}

    # the fused arm does basic's every-step work: each step's gradient norm (torch's total norm of the gradients the
    # step left), a reset sentinel (set_to_none), one pass, stepped, not on the same gradients, the input's range
    fused = floor.fused_arm(floor.workloads.get("small"))
    for n in range(3):
        fused.step()
        step, loss, norms, reset, (lo, hi), passes, stepped, repeat = fused.ring[-1]
        grads = [q.grad for q in fused.model.parameters()]
        assert step == n and loss.ndim == 0 and passes == 1 and stepped and not repeat and reset is True
        assert torch.equal(torch.linalg.vector_norm(torch.stack(norms)), torch.nn.utils.get_total_norm(grads))
        assert float(lo) <= float(hi)


def test_builds_compares_two_builds_in_one_process(tmp_path: Path) -> None:
    """benchmarks/builds.py against this very checkout: the other build is imported under its own name (its session
    runs beside this one's and records its own run), and the table has a row per preset with both builds' figures."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(BENCH / "builds.py"), str(ROOT), "--presets", "basic", "--rounds", "2",
                           "--steps", "30", "--warmup", "30"], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| basic |"))
    this, other, cheaper, diff = (c.strip() for c in row.strip("|").split("|")[1:])
    assert math.isfinite(float(this)) and math.isfinite(float(other)) and math.isfinite(float(diff))
    assert cheaper in ("0/2", "1/2", "2/2")


def test_tracker_startup_times_each_arm_in_a_process_of_its_own(tmp_path: Path) -> None:
    """benchmarks/tracker_startup.py: one fresh process per arm and round (the delivery worker's cost is
    process-wide, so it cannot be interleaved); a row per arm with one block time per 50 steps, all finite, the bare
    loop's below the session's first block (its first steps are all logging steps)."""
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(BENCH / "tracker_startup.py"), "--arms", "none", "local", "--steps",
                           "100", "--rounds", "1", "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["arm"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"none", "local"}
    assert all(len(r["blocks_ms"]) == 2 and all(math.isfinite(b) and b > 0 for b in r["blocks_ms"]) for r in rows.values())
    assert rows["none"]["blocks_ms"][0] < rows["local"]["blocks_ms"][0], proc.stdout
    assert "| local |" in proc.stdout and "| none |" in proc.stdout


def test_op_trace_profiles_each_arm_beside_the_bare_loop(tmp_path: Path) -> None:
    """benchmarks/op_trace.py on the small MLP: one profiled section per arm with finite timings, and the
    operations trackdiag adds show in its arm only (the gradient tap's one multi-tensor norm per backward)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = warm.run([sys.executable, str(BENCH / "op_trace.py"), "--workload", "small", "--arms", "advanced",
                           "--steps", "5", "--warmup", "3", "--top", "60"], capture_output=True, text=True, timeout=240,
                    env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = {}
    for line in proc.stdout.splitlines():
        if line.startswith("## "):
            name = line[3:].split(":")[0]
            sections[name] = {"header": line, "ops": set()}
        elif line.startswith("| ") and sections and not line.startswith("| op "):
            sections[name]["ops"].add(line.strip("|").split("|")[0].strip())
    assert set(sections) == {"bare", "advanced"}, proc.stdout[-2000:]
    for sec in sections.values():
        assert math.isfinite(float(sec["header"].split(": ")[1].split(" ms/step")[0])), sec["header"]
    assert "aten::_foreach_norm" in sections["advanced"]["ops"] and "aten::_foreach_norm" not in sections["bare"]["ops"]


def test_overhead_compiled_table_counts_dynamo(tmp_path: Path) -> None:
    """``--compile``: bare/basic/advanced on compiled models, finite ratios (or a reported failure,
    never a crash) and Dynamo's counts per arm. The ``aot_eager`` backend: Dynamo's graphs, breaks and recompiles
    are the backend's input, so the counts are Inductor's too, without its C++ builds (~35 CPU-s on a fresh
    2-core machine, issue 47); Inductor under a session is tests/test_compile.py's."""
    res, stdout = _overhead(tmp_path, "--workloads", "gpt_tiny", "--compile", "--backend", "aot_eager", "--rounds", "2", "--steps", "5", "--warmup", "5", "--markdown")
    rows = {r["arm"]: r for r in res["rows"]}
    assert set(rows) == {"bare", "basic", "advanced"} and "compile: on" in res["environment"]
    assert _finite(rows["bare"]) and rows["bare"]["graph_breaks"] == 0 and rows["bare"]["unique_graphs"] >= 1
    for arm in ("basic", "advanced"):
        r = rows[arm]
        assert _finite(r) or r["error"], r
        assert all(isinstance(r[k], int) for k in ("graph_breaks", "unique_graphs", "frames_compiled", "recompile_limit_hits"))
    assert "graph breaks / graphs / frames" in stdout and "gpt_tiny (compiled)" in stdout


# ---------------------------------------------------------------- CUDA (scripts/gpu_check.sh)
@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("extra", [["--workloads", "gpt_tiny", "--compile"], ["--workloads", "mlp", "gpt_tiny", "--amp", "fp16"],
                                   ["--workloads", "gpt_tiny", "--amp", "bf16", "--arms", "disabled", "basic", "advanced", "extreme"]])
def test_cuda_overhead_runs(tmp_path: Path, extra: list[str]) -> None:
    """The GPU benchmark's three modes on small workloads: compiled, fp16 with a GradScaler, bf16 autocast."""
    res, _ = _overhead(tmp_path, "--device", "cuda", "--rounds", "2", "--steps", "10", "--warmup", "10", *extra, timeout=300)
    assert res["rows"] and res["complete"]
    assert torch.cuda.get_device_name() in res["environment"]
    for r in res["rows"]:
        assert _finite(r) or (r["arm"] != "bare" and r["error"]), r


def _gpt_tiny_cuda(device: str = "cuda"):
    sys.path.insert(0, str(BENCH))
    try:
        from gpt import GPT_WORKLOADS
    finally:
        sys.path.remove(str(BENCH))
    wl = GPT_WORKLOADS["gpt_tiny"]
    torch.manual_seed(0)
    return wl, wl.make_model().to(device), torch.Generator(device=device).manual_seed(1)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_session_under_autocast(tmp_path: Path, dtype: torch.dtype) -> None:
    session_under_autocast(tmp_path, dtype, "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_session_under_autocast_on_cpu(tmp_path: Path, dtype: torch.dtype) -> None:
    """The CUDA test's body on the CPU, so that it cannot go stale between GPU checks."""
    session_under_autocast(tmp_path, dtype, "cpu")


def session_under_autocast(tmp_path: Path, dtype: torch.dtype, device: str) -> None:
    """nanoGPT's loop under autocast (fp16: GradScaler, unscale_, clip): the session keeps every probe,
    logs finite unscaled gradient norms, and sees a planted overflow as exactly one skipped step."""
    import trackdiag
    from trackdiag.core.record import read_records

    wl, model, g = _gpt_tiny_cuda(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    diag = trackdiag.Diagnostics(model, opt, scaler, level="advanced", every=5, sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"enabled": False}, "landscape": {"enabled": False}})
    for step in range(16):
        x, y = wl.make_batch(g)
        with torch.autocast(device, dtype=dtype):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), y.reshape(-1))
        scaler.scale(loss * (float("inf") if step == 7 and scaler.is_enabled() else 1.0)).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        diag.step(loss, outputs=out, batch=(x, y))
    diag.close()
    assert diag.summary()["disabled_probes"] == {}
    recs = list(read_records(next(p.parent for p in tmp_path.rglob("records.jsonl"))))
    norms = [v for r in recs for k, points in r.series.items() if k.endswith("grad/global_norm") for _, v in points]
    assert norms and all(math.isfinite(v) for v in norms)  # the skipped step's Inf never reaches the optimizer-step hook
    if scaler.is_enabled():
        backoffs = sum(r.scalars.get(k, 0) for r in recs for k in r.scalars if k.endswith("amp/backoffs"))
        assert backoffs == 1


@cuda
@pytest.mark.cuda
def test_cuda_memory_snapshot_is_written(tmp_path: Path) -> None:
    import trackdiag

    wl, model, g = _gpt_tiny_cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    diag = trackdiag.Diagnostics(model, opt, level="basic", sinks=["local"], output_dir=str(tmp_path),
                                 probes={"report": {"memory_snapshot_steps": 3, "html": False}})
    for _ in range(5):
        x, y = wl.make_batch(g)
        loss = wl.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        diag.step(loss)
    diag.close()
    (snap,) = tmp_path.rglob("memory_snapshot.pickle")
    with open(snap, "rb") as f:
        data = pickle.load(f)
    assert data["segments"] and data["device_traces"]

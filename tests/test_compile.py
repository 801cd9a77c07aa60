"""torch.compile: trackdiag adds no graph break and no recompile at any preset (Dynamo's own
counters, with and without a session, on the same model), ``fullgraph=True`` works, and the
diagnostics that need module outputs still work (they run eagerly outside the compiled graph).

The char-GPT compiles with the ``aot_eager`` backend: Dynamo and AOTAutograd, where trackdiag's hooks, guards and
graph breaks live, give the backend the same graphs whichever it is, without Inductor's C++ builds (~60 CPU-s for
this model on a fresh 2-core machine, issue 47). Inductor, the default users get, compiles an MLP end to end
(:func:`test_inductor_end_to_end_at_every_preset`)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import trackdiag
import _warm as warm
from _loops import CharGPT, char_batches, char_data
from _zoo_a import one_thread
from trackdiag.core.record import read_records

pytestmark = pytest.mark.slow
BACKEND = "aot_eager"  # the char-GPT's (module doc)
LEAN = {"report": {"enabled": False}, "landscape": {"enabled": False}, "histograms": {"enabled": False}}


def run(tmp_path, level: str | None, style: str, steps: int = 8, warm_up: bool = False, fault_at: int | None = None):
    """Train a compiled char-GPT; returns (graph breaks, unique graphs, recompiles, session)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    data, vocab = char_data()
    model = CharGPT(vocab)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    if style == "wrap":
        cm = torch.compile(model, fullgraph=True, backend=BACKEND)
    else:
        cm = model
        model.compile(fullgraph=True, backend=BACKEND)
    batches = char_batches(data, 32, 8)

    def train_step(x, y):
        logits, loss = cm(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return logits, loss

    if warm_up:  # compiled and run before the session exists
        train_step(*next(batches))
    diag = None
    if level is not None:
        diag = trackdiag.Diagnostics(cm, opt, level=level, every=3, sinks=["local"], output_dir=str(tmp_path),
                                     probes={**LEAN, "activations": {"every": 3}})
    with one_thread():
        for step in range(steps):
            x, y = next(batches)
            if fault_at is not None and step == fault_at:  # the planted fault: log(0) in block 1's attention
                model.h[1].attn.fault.fill_(1.0)
            logits, loss = train_step(x, y)
            if diag is not None:
                diag.step(loss, outputs=logits, batch=(x, y))
    if diag is not None:
        diag.close()
    recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], recompiles, diag


@pytest.mark.parametrize("style", ["wrap", "inplace"])
def test_no_graph_break_or_recompile_at_any_preset(tmp_path, style: str) -> None:
    bare = run(tmp_path / "bare", None, style)[:3]
    assert bare[0] == 0 and bare[1] >= 1
    for level in ("basic", "advanced", "extreme"):
        breaks, graphs, recompiles, diag = run(tmp_path / level, level, style)
        assert (breaks, graphs, recompiles) == bare, level
        assert diag.summary()["disabled_probes"] == {}, level
        recs = list(read_records(tmp_path / level))
        norms = [p for r in recs for p in r.series.get("diag/grad/global_norm", [])]
        assert [s for s, _ in norms] == list(range(8)), level
        if level != "basic":  # activations measured by an eager no-grad forward of the step's batch
            assert any(k.startswith("diag/act/") for r in recs for k in r.scalars), level


def test_inductor_end_to_end_at_every_preset(tmp_path) -> None:
    """Inductor, the default backend: an MLP compiled with it trains under each preset with the graphs, breaks and
    recompiles of the bare compiled loop, and every step's pre-clip gradient norm recorded, equal to the one
    ``clip_grad_norm_`` returned."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def train(level: str | None, out):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        cm = torch.compile(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        diag = None if level is None else trackdiag.Diagnostics(cm, opt, level=level, every=2, sinks=["local"],
                                                                output_dir=str(out), probes=LEAN)
        norms = []
        with one_thread():
            for _ in range(6):
                x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
                logits = cm(x)
                loss = F.cross_entropy(logits, y)
                loss.backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)))
                opt.step(); opt.zero_grad()
                if diag is not None:
                    diag.step(loss, outputs=logits, batch=(x, y))
        if diag is not None:
            diag.close()
        recompiles = sum(counters["recompiles"].values()) if "recompiles" in counters else 0
        return (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], recompiles), norms, diag

    bare, bare_norms, _ = train(None, None)
    assert bare[0] == 0 and bare[1] >= 1
    for level in ("basic", "advanced", "extreme"):
        got, norms, diag = train(level, tmp_path / level)
        assert got == bare, level
        assert diag.summary()["disabled_probes"] == {}, level
        assert norms == bare_norms, level  # the session changes nothing the loop computes
        logged = [p for r in read_records(tmp_path / level) for p in r.series.get("diag/grad/global_norm", [])]
        assert [s for s, _ in logged] == list(range(6)) and [v for _, v in logged] == pytest.approx(norms), level


def test_compiled_before_the_session_adds_no_recompile(tmp_path) -> None:
    bare = run(tmp_path / "bare", None, "wrap", warm_up=True)[:3]
    got = run(tmp_path / "adv", "advanced", "wrap", warm_up=True)[:3]
    assert got == bare


def test_nan_culprit_is_named_in_a_compiled_model(tmp_path) -> None:
    *_, diag = run(tmp_path, "advanced", "wrap", steps=8, fault_at=4)
    a = next(a for a in diag.alerts if a.kind == "nonfinite_loss")
    assert a.step == 4 and a.where == "h.1.attn (input finite)", a


def test_compiled_model_without_batch_says_activations_are_not_recorded(tmp_path) -> None:
    """Under compile, activations come from an eager forward of step(batch=...): without a batch the
    session says so (console and summary()["notes"]) instead of leaving diag/act/* silently empty."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cm = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diag = trackdiag.Diagnostics(cm, opt, level="advanced", every=3, sinks=["local"], output_dir=str(tmp_path),
                                 probes={**LEAN, "activations": {"every": 3}})
    with one_thread(), diag:
        for _ in range(7):
            loss = F.cross_entropy(cm(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
            loss.backward(); opt.step(); opt.zero_grad(); diag.step(loss)
    notes = diag.summary()["notes"]
    assert sum("step(batch=...)" in n for n in notes) == 1, notes
    assert not any(k.startswith("diag/act/") for r in read_records(tmp_path) for k in r.scalars)


def test_trackdiags_own_call_slot_is_not_taken_for_a_compiled_model(tmp_path) -> None:
    """trackdiag watches a root through the slot ``module.compile()`` uses: an eager model that a
    session watches is still eager to the next session (and to the pre-flight, which hooks only
    eager models), a compiled one is still compiled."""
    from trackdiag.capture.forward_watch import compiled_parts

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    first = trackdiag.Diagnostics(model, None, level="advanced", sinks=["local"], output_dir=str(tmp_path / "a"))
    assert model.__dict__.get("_compiled_call_impl") is not None  # the NaN replay's watcher holds the slot
    assert compiled_parts(model) == []
    second = trackdiag.Diagnostics(model, None, level="advanced", sinks=["local"], output_dir=str(tmp_path / "b"))
    assert second._ctx.compiled is False
    second.close()
    first.close()
    model.compile()
    assert compiled_parts(model) == [""]


def test_pause_counters_live_in_the_instances_from_the_start() -> None:
    """Dynamo guards on *where* ``_paused`` is found: had it stayed a class attribute until the first
    ``paused()`` (the pre-flight's, at ``extreme``), a model compiled before that would be recompiled
    there (the [inplace] case above failed when it ran first in its process). A fresh process, so no
    earlier test has paused anything."""
    code = ("from trackdiag.capture.forward_watch import FORWARD; from trackdiag.capture.optimizers import DISPATCH; "
            "print('_paused' in vars(FORWARD), '_paused' in vars(DISPATCH))")
    import sys

    out = warm.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True"], out.stderr[-2000:]

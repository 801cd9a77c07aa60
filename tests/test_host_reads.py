"""Cheap by construction: nothing is read back to the host on non-logging steps, one copy per logging step.

On CPU a "host read" cannot stall anything, but the ops that would on CUDA are the same: values turned
into Python numbers (``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``float()``), ops whose
output shape depends on the data (``nonzero``, ``masked_select``...), and tensors made from host data. A dispatch mode counts them around
whole training steps, with and without a session, and a spy counts ``to_host`` (the batched copy).
The CUDA test checks the real thing with ``torch.cuda.set_sync_debug_mode`` and skips without a GPU.
"""
from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import trackdiag
import trackdiag.session.diagnostics
from conftest import LEAN_PROBES, batches, make_mlp

# sync on CUDA: a value turned into a Python number, or an output sized by the data (bincount reads its max),
# or a kernel that reads a count back itself (CUDA's nanmedian: its NaN count), or a tensor made from host
# data (``torch.tensor(list, device=...)``: ``lift_fresh``, then a synchronous host-to-device copy)
READS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "unique_dim", "unique_consecutive", "bincount",
         "repeat_interleave", "nanmedian", "lift_fresh"}


class HostReads(TorchDispatchMode):
    """Counts the ops that read device values back to the host (or sync to size their output)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = func.overloadpacket.__name__
        if name in READS:
            self.ops[name] += 1
        elif name in ("index", "index_put", "index_put_") and any(  # x[mask]: a nonzero inside the kernel
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None):
            self.ops[f"{name}(bool mask)"] += 1
        return func(*args, **(kwargs or {}))


def _train(digits, steps: int, diag=None, device: str = "cpu", watch=None, scaler: bool = False) -> list[Counter[str]]:
    """``steps`` plain SGD steps (a loop that itself reads nothing back, unless a ``GradScaler`` steps it);
    per step, the host reads seen. A probe that failed (and was switched off) fails the test: its
    reads, or its sync error under CUDA's sync debug mode, would otherwise go unseen."""
    x, y = digits
    torch.manual_seed(0)
    model = make_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    amp = torch.amp.GradScaler(device, init_scale=256.0) if scaler else None
    session = diag(model, opt, amp) if diag else None
    data = batches(x, y)
    seen = []
    for step in range(steps):
        xb, yb = (t.to(device) for t in next(data))
        with (watch(step) if watch else HostReads()) as mode:
            out = model(xb)
            loss = F.cross_entropy(out, yb)
            if amp is None:
                loss.backward()
                opt.step()
            else:
                amp.scale(loss).backward()
                amp.step(opt)
                amp.update()
            opt.zero_grad(set_to_none=True)
            if session is not None:
                session.step(loss, outputs=out, batch=(xb, yb))
        seen.append(getattr(mode, "ops", Counter()))
    if session is not None:
        session.close()
        assert session.summary()["disabled_probes"] == {}
    return seen


def _copies(monkeypatch) -> list[int]:
    """Spy on the session's batched device-to-host copy: one entry per call."""
    calls: list[int] = []
    real = trackdiag.session.diagnostics.to_host

    def spy(values):
        calls.append(len(calls))
        return real(values)

    monkeypatch.setattr(trackdiag.session.diagnostics, "to_host", spy)
    return calls


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_non_logging_steps_read_nothing_back(digits, tmp_path, monkeypatch, level: str) -> None:
    every = 5
    probes = {**LEAN_PROBES, "nan_replay": {"mode": "log"}, "landscape": {"enabled": False}}
    bare = _train(digits, 21)
    assert sum(bare, Counter()) == Counter()  # the control loop itself reads nothing back
    copies = _copies(monkeypatch)
    make = lambda m, o, s: trackdiag.Diagnostics(m, o, s, level=level, every=every, sinks=["local"],  # noqa: E731
                                                 output_dir=str(tmp_path), probes=probes)
    seen = _train(digits, 21, make)
    reads = {step: dict(ops) for step, ops in enumerate(seen) if ops}
    allowed = {0} if level == "extreme" else set()  # extreme's automatic pre-flight runs on the first batch
    assert set(reads) == allowed, f"host reads at {level}: {reads}"
    # logging steps 0, 5, 10, 15, 20 (and, where the update ratio runs, each of the first 10 steps): one copy each
    early = 10 if level != "basic" else 0
    assert len(copies) == len({s for s in range(21) if s % every == 0 or s < early})


@pytest.mark.parametrize("level", ["basic", "advanced"])
def test_flight_recorder_module_flags_read_nothing_back(digits, tmp_path, monkeypatch, level: str) -> None:
    """The per-module output flags (``probes.flight.modules``) are device work: they reach the host
    only in the logging step's one batched copy."""
    copies = _copies(monkeypatch)
    probes = {**LEAN_PROBES, "flight": {"modules": True}}
    make = lambda m, o, s: trackdiag.Diagnostics(m, o, s, level=level, every=5, sinks=["local"],  # noqa: E731
                                                 output_dir=str(tmp_path), probes=probes)
    seen = _train(digits, 16, make)
    assert {step: dict(ops) for step, ops in enumerate(seen) if ops} == {}
    early = 10 if level != "basic" else 0
    assert len(copies) == len({s for s in range(16) if s % 5 == 0 or s < early})


def test_exact_step_nan_replay_reads_one_flag_per_step(digits, tmp_path) -> None:
    """``nan_replay: {mode: step}`` pays exactly one host read per step, by design (the finiteness flag)."""
    make = lambda m, o, s: trackdiag.Diagnostics(m, o, s, level="basic", every=5, sinks=["local"],  # noqa: E731
                                                 output_dir=str(tmp_path), probes={"nan_replay": {"enabled": True, "mode": "step"}})
    seen = _train(digits, 12, make)
    assert [dict(ops) for ops in seen] == [{"_local_scalar_dense": 1}] * 12


def test_with_a_grad_scaler_the_session_adds_no_host_read(digits, tmp_path) -> None:
    """``GradScaler.step`` reads its found-inf flag every step; the session (AMP probes included)
    reads nothing more than the bare loop does, step by step."""
    bare = _train(digits, 16, scaler=True)
    assert all(ops for ops in bare)  # the control: the scaler's own reads are seen
    make = lambda m, o, s: trackdiag.Diagnostics(m, o, s, level="advanced", every=5, sinks=["local"],  # noqa: E731
                                                 output_dir=str(tmp_path), probes=LEAN_PROBES)
    assert _train(digits, 16, make, scaler=True) == bare


#: CUDA runs: (level, probe overrides); extreme without the exact-step NaN replay (one sync per step by
#: design, tested above) and the landscape (a run of its own at close)
CUDA_CASES = {
    "basic": ("basic", {}),
    "advanced": ("advanced", {}),
    "advanced-module-flags": ("advanced", {"flight": {"modules": True}}),  # the CUDA batching path of the flags
    "extreme": ("extreme", {"nan_replay": {"mode": "log"}, "landscape": {"enabled": False}}),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_non_logging_steps_never_sync_and_logging_steps_sync_once(digits, tmp_path, monkeypatch, case: str) -> None:
    """``set_sync_debug_mode("error")`` around every step without a copy to the host (whole step: forward,
    backward, optimizer hooks, ``step()``); on steps with one, the synchronisations counted must be exactly
    one. The first step may add a few: the layer indexes go to the device once (a host-to-device copy waits
    for it), and extreme's first step also runs the automatic pre-flight (89 on an H100)."""
    level, overrides = CUDA_CASES[case]
    every, steps = 5, 21  # the last step logs: nothing is left for close() to copy
    early = 10 if level != "basic" else 0  # the update ratio's first steps, one by one
    copying = {s for s in range(steps) if s % every == 0 or s < early}
    per_copy_step: dict[int, int] = {}

    class Watch:
        def __init__(self, step: int) -> None:
            self.step, self.copying = step, step in copying
            self.caught: list = []

        def __enter__(self):
            torch.cuda.synchronize()
            self._w = warnings.catch_warnings(record=True)
            self.caught = self._w.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn" if self.copying else "error")
            return self

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode("default")
            self._w.__exit__(*exc)
            if self.copying:
                per_copy_step[self.step] = sum("synchroniz" in str(w.message) for w in self.caught)
            return False

    copies = _copies(monkeypatch)
    make = lambda m, o, s: trackdiag.Diagnostics(m, o, s, level=level, every=every, sinks=["local"],  # noqa: E731
                                                 output_dir=str(tmp_path), probes={**LEAN_PROBES, **overrides})
    _train(digits, 3, device="cuda")  # warm the CUDA context outside the checked steps
    _train(digits, steps, make, device="cuda", watch=Watch)
    print(f"{case}: synchronisations per step with a copy: {per_copy_step}")
    assert len(copies) == len(copying)
    assert all(n >= 1 for n in per_copy_step.values()), per_copy_step
    assert {s: n for s, n in per_copy_step.items() if s != 0 and n != 1} == {}, per_copy_step
    if level != "extreme":
        assert per_copy_step[0] <= 2, per_copy_step  # seen on an H100: 2 (the copy, the layer index upload)

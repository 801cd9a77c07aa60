"""The NaN culprit when a replay cannot reproduce the fault: a fault that happens once, layers called
through ``.forward()`` (hooks never run), a LightningModule without ``forward``. With the flight
recorder's per-module flags the hooks of the real step name the module; without them the alert says
plainly that the culprit could not be found (never "arises outside the model" for a replay on other
weights). Each fault in two loop styles (tests/_zoo_crash.py); healthy loops stay silent."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _zoo_crash as zoo

FLAGS = {"flight": {"modules": True}}
NO_FLAGS = {"flight": {"modules": False}}


def _nan(diag: Any) -> Any:
    got = [a for a in diag.alerts if a.kind in ("nonfinite_loss", "nonfinite_grad")]
    assert got, [a.describe() for a in diag.alerts]
    return got[0]


def _raised_at(diag: Any, alert: Any) -> int:
    from trackdiag.core.record import read_records

    return next(r.step for r in read_records(diag.run.output_dir) if any(a.kind == alert.kind for a in r.alerts))


@pytest.mark.parametrize(("script", "where"), [
    ("mlp", "2 (TransientGate, input finite, seen in the step's forward)"),
    ("gru", "proj (input finite, seen in the step's forward)"),
])
@pytest.mark.parametrize("level", ["advanced", "extreme"])
def test_a_fault_that_happens_once_is_named_from_the_real_step(tmp_path, script, where, level):
    diag = getattr(zoo, script)(level, tmp_path, transient_at=13, probes=FLAGS)
    alert = _nan(diag)
    assert alert.step == 13 and alert.where == where, alert.describe()
    assert _raised_at(diag, alert) - 13 <= 10
    assert "Flight recorder of step 13" in alert.message and "did not reproduce" in alert.message
    assert "arises outside the model" not in alert.message


@pytest.mark.parametrize("script", ["mlp", "gru"])
def test_without_the_flags_the_alert_says_the_culprit_was_not_found(tmp_path, script):
    diag = getattr(zoo, script)("advanced", tmp_path, transient_at=13, probes=NO_FLAGS)
    alert = _nan(diag)
    assert alert.step == 13 and alert.where == "diag/loss", alert.describe()
    assert "The culprit could not be found" in alert.message and "did not reappear" in alert.message
    assert "arises outside the model" not in alert.message
    assert "flight.modules=true" in alert.message


@pytest.mark.parametrize("flags", [False, True])
def test_layers_called_through_forward_are_seen_by_the_replay(tmp_path, flags):
    diag = zoo.dotforward("advanced", tmp_path, onset=13, probes=FLAGS if flags else NO_FLAGS)
    alert = _nan(diag)
    assert alert.step == 13 and alert.where == "mid (input finite)", alert.describe()  # the replay watches .forward()


def test_a_model_driven_through_forward_calls_by_the_loop(tmp_path, caplog):
    """No root forward, the gated layer called as ``.forward()`` (no hook sees it): the replay runs the
    outermost module calls the hooks did see, in order, and the first non-finite one is ``mix.inner``
    fed an input that already held NaN (made between hooked calls: the alert says to look there); the
    flags see the same in the real step; with the user's loss the replay runs the loop's step and
    names the gate itself."""
    caplog.set_level("WARNING", logger="trackdiag")
    plain = _nan(zoo.cellloop("advanced", tmp_path / "a", onset=13, probes=NO_FLAGS))
    assert plain.where == "mix.inner (input non-finite)", plain.describe()
    assert "its input already held NaN/Inf" in plain.message and "functional ops between modules" in plain.hint
    assert not [r for r in caplog.records if "nan_replay skipped" in r.getMessage()]
    seen = _nan(zoo.cellloop("advanced", tmp_path / "b", onset=13, probes=FLAGS))
    assert seen.where.startswith("mix.inner (input non-finite"), seen.describe()
    replayed = _nan(zoo.cellloop("advanced", tmp_path / "c", onset=13, probes=NO_FLAGS, user_loss=True))
    assert replayed.where == "mix (input finite)", replayed.describe()


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
@pytest.mark.parametrize("script", ["mlp", "gru", "dotforward", "cellloop"])
def test_healthy_loops_stay_silent(tmp_path, level, script):
    diag = getattr(zoo, script)(level, tmp_path, steps=25)
    assert [a for a in diag.alerts if a.severity != "info"] == [], [a.describe() for a in diag.alerts]


# ------------------------------------------------------------------------------------- Lightning
def _lightning() -> Any:
    """``lightning.pytorch``, imported by the Lightning tests only (not at collection: it costs every xdist
    worker seconds, and a module-level skip would skip this file's other tests too without it)."""
    return pytest.importorskip("lightning.pytorch", reason="pip install 'trackdiag[lightning]'")


def _no_forward(onset: int | None) -> Any:
    """The LightningModule style without ``forward``: ``training_step`` calls the sub-modules."""

    class NoForward(_lightning().LightningModule):
        def __init__(self, onset: int | None) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
            self.mixer = zoo.NanGate(nn.Linear(32, 32))
            self.head = nn.Linear(32, 10)
            self.onset = onset

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.mixer.fault.fill_(1.0 if self.onset is not None and self.global_step >= self.onset else 0.0)
            x, y = batch
            return F.cross_entropy(self.head(torch.relu(self.mixer(self.encoder(x)))), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), 1e-3)

    return NoForward(onset)


def _fit(tmp_path: Any, onset: int | None, **kw: Any) -> Any:
    from trackdiag.integrations.lightning import DiagnosticsCallback

    pl = _lightning()

    x, y = zoo.digits()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:640], y[:640]), batch_size=32)
    cb = DiagnosticsCallback("advanced", every=5, output_dir=str(tmp_path / "run"), sinks=["local"],
                             probes={**zoo.LEAN, **kw.pop("probes", {})}, **kw)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=20, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])
    with zoo.one_thread():
        trainer.fit(_no_forward(onset), data)
    return cb


@pytest.mark.parametrize("how", ["flags", "loss_fn", "neither"])
def test_a_lightning_module_without_forward(tmp_path, how):
    kw: dict[str, Any] = {"probes": FLAGS if how == "flags" else NO_FLAGS}
    if how == "loss_fn":
        kw["loss_fn"] = lambda m, b: F.cross_entropy(m.head(torch.relu(m.mixer(m.encoder(b[0])))), b[1])
    alert = _nan(_fit(tmp_path, 12, **kw))
    assert alert.step == 12, alert.describe()
    # no forward: the replay runs the sub-module calls training_step made (or the user's loss), in order
    assert alert.where == "mixer (input finite)", alert.describe()
    assert "the first non-finite value comes out of mixer" in alert.message


def test_a_healthy_lightning_module_without_forward_is_silent(tmp_path):
    cb = _fit(tmp_path, None, probes=FLAGS)
    assert [a for a in cb.alerts if a.severity != "info"] == [], [a.describe() for a in cb.alerts]


@pytest.mark.parametrize("batched,chunk", [(False, 64), (True, 2), (True, 64)])
def test_output_flags_name_the_first_module_and_its_input(batched, chunk):
    """OutputFlags alone, on the CPU path (one sum per output) and on the CUDA path's batching (tensors
    wait for one multi-tensor kernel, exercised here on CPU tensors: every ``chunk`` tensors, 2: several per
    forward, or only at the end of the step, 64)."""
    from trackdiag.capture.context import Component, ProbeContext
    from trackdiag.capture.layers import LayerIndex
    from trackdiag.capture.output_flags import OutputFlags

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), zoo.NanGate(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2))
    comp = Component("", model, None, LayerIndex.build(model, list(model.parameters()), 64))
    flags = OutputFlags(ProbeContext([comp], 5, 64), ring=3, chunk=chunk)
    if batched:
        flags.batched = lambda t: True  # type: ignore[method-assign]
    flags.start()
    try:
        for step in range(4):
            model[2].fault.fill_(1.0 if step == 2 else 0.0)
            model(torch.randn(3, 4)).sum().backward()
            with torch.no_grad():
                model(torch.full((3, 4), torch.nan))  # an evaluation forward: not recorded
            flags.end_step(step)
        model[2].fault.fill_(1.0)
        model(torch.randn(3, 4))  # the step in progress (a crash before step() ends it)
        assert flags.first_bad(1) is None and flags.recorded(1) == 6  # the Sequential hands its child's output on
        assert flags.first_bad(2) == (("", "2"), True, 6, 3)  # 2, 3 and 4 non-finite (2.inner not); 2's input finite
        assert flags.first_bad(4, running=True) == (("", "2"), True, 6, 3)
        assert flags.first_bad(0) is None  # out of the ring of 3 steps
        # 6 outputs + the batch (every other input is one of the last outputs recorded: 2's is 1's)
        assert flags.device_flags(3) is not None and flags.device_flags(3).shape == (7,)
        values = [0.0] * 7
        values[flags._steps[3].outs[0]] = float("nan")
        flags.learn(3, values)  # module 0 non-finite on a healthy step: habitual
        assert ("", "0") in flags.habitual
    finally:
        flags.stop()


def test_output_flags_of_a_step_judged_healthy_are_never_computed():
    """With the NaN replay's per-step judgement (``mode=step``), a healthy non-logging step's held outputs
    are let go without a kernel; the bad step, a logging step and a step whose last forward came after the
    judgement still get their flags."""
    from trackdiag.capture.context import Component, ProbeContext
    from trackdiag.capture.layers import LayerIndex
    from trackdiag.capture.output_flags import OutputFlags

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), zoo.NanGate(nn.Linear(8, 8)), nn.Tanh(), nn.Linear(8, 2))
    comp = Component("", model, None, LayerIndex.build(model, list(model.parameters()), 64))
    flags = OutputFlags(ProbeContext([comp], 5, 64), ring=8)
    sums = []
    real_sum = torch.Tensor.sum
    flags.start()
    try:
        torch.Tensor.sum = lambda t, *a, **k: (sums.append(1), real_sum(t, *a, **k))[1]  # type: ignore[method-assign]
        for step in range(5):
            model[2].fault.fill_(1.0 if step == 2 else 0.0)
            loss = model(torch.randn(3, 4)).pow(2).mean()
            loss.backward()
            flags.judged(bool(torch.isfinite(loss)))
            if step == 3:
                model(torch.randn(3, 4))  # a forward after the judgement: not covered by it
            before = len(sums)
            flags.end_step(step, due=step == 4)
            computed = len(sums) - before
            assert computed == (0 if step in (0, 1) else 7 if step in (2, 4) else 14), (step, computed)  # 6 outputs + the batch per forward
        torch.Tensor.sum = real_sum  # type: ignore[method-assign]
        assert flags.device_flags(1) is None and flags.recorded(1) == 6 and flags.first_bad(1) is None
        assert flags.first_bad(2) == (("", "2"), True, 6, 3)
        assert flags.device_flags(4).shape == (7,)
    finally:
        torch.Tensor.sum = real_sum  # type: ignore[method-assign]
        flags.stop()


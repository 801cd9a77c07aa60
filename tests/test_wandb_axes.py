"""W&B: the ``diag/alerts/*`` series on the loss's step axis, and ``sink.wandb.settings`` checked before training.

There is no W&B server here: "the run page" is what the page is built from, the history rows and
the metric definitions in the run's ``.wandb`` file (read back with ``tests/wandb_reader.py``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

import torch  # noqa: E402

import trackdiag  # noqa: E402
from trackdiag.config.load import resolve  # noqa: E402
from trackdiag.core.alert import Alert  # noqa: E402
from trackdiag.core.errors import ConfigError  # noqa: E402
from trackdiag.core.record import Record  # noqa: E402
from trackdiag.core.runinfo import RunInfo  # noqa: E402
from trackdiag.sinks.wandb import WandbSink  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from wandb_reader import LEAN, read_run, settled_runs, offline, tiny_model as _model  # noqa: E402,F401 (offline: an autouse fixture)



def _train(d: trackdiag.Diagnostics, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
           nan_step: int | None = None) -> None:
    for step in range(steps):
        x = torch.randn(16, 4)
        if step == nan_step:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        opt.zero_grad(), loss.backward(), opt.step()
        d.step(loss)


# ---------------------------------------------------------------------------- item 2: the step axis
def test_alert_series_share_the_loss_step_axis(tmp_path: Path) -> None:
    """A real session, NaN planted at step 12 of 30: the alert series' rows carry the loss's step key
    and value, the series spans the loss's steps (0 before the alert, the count at the end), and the
    metric definitions put diag/alerts/<kind> on the loss's step metric by name."""
    model, opt = _model()
    d = trackdiag.Diagnostics(model, opt, level="advanced", sinks=["wandb"], output_dir=str(tmp_path / "rec"),
                              sink={"wandb": {"mode": "offline", "dir": str(tmp_path), "settings": LEAN}})
    _train(d, model, opt, 30, nan_step=12)
    d.close()
    run = read_run(settled_runs(tmp_path)[0])
    key = "diag/alerts/nonfinite_loss"
    emitted = sorted(a.step for a in d.alerts if a.kind == "nonfinite_loss")
    assert emitted and emitted[0] == 12

    loss_steps = [s for s, _ in run.series("diag/loss")]
    alert_rows = [r for r in run.history if key in r]
    assert alert_rows and all("diag/step" in r for r in alert_rows)  # never on W&B's own _step only
    for step in emitted:  # at the alert's step, the same step key and value as the loss's row
        assert any(r["diag/step"] == step for r in alert_rows) and step in loss_steps
    counts = dict(run.series(key))
    assert {s: counts[s] for s in emitted} == {s: i + 1 for i, s in enumerate(emitted)}
    assert min(counts) == loss_steps[0] == 0 and counts[0] == 0  # starts where the loss starts
    assert counts[emitted[0] - 1] == 0  # flat at 0 until the step before the alert
    assert max(counts) == loss_steps[-1] == 29 and counts[29] == len(emitted)  # ends where the loss ends

    by_name = {m.name: m.step_metric for m in run.metrics if m.name}
    assert by_name[key] == by_name["diag/loss"] == "diag/step"
    assert {m.glob_name: m.step_metric for m in run.metrics if m.glob_name} == {"diag/*": "diag/step"}


def test_alert_series_step_shape_hand_built(tmp_path: Path) -> None:
    """The same shape as the MLflow sink's: 0 at the first step, the previous count one step before
    each alert, the count at its step, the final count at the last step."""
    sink = WandbSink(mode="offline", dir=str(tmp_path), name="axes", settings=LEAN, notify=None)
    sink.open(RunInfo("r", tmp_path / "rec", "basic", {"level": "basic"}))
    for step in range(21):
        sink.write(Record(step=step, scalars={"diag/loss": 1.0 / (step + 1)}))
        if step in (10, 12):
            sink.alert(Alert("grad_explosion", step, "warning", "big"))
        sink.flush()
    sink.close("FINISHED", {"alerts": {}})
    run = read_run(settled_runs(tmp_path)[0])
    assert run.series("diag/alerts/grad_explosion") == [(0, 0), (9, 0), (10, 1), (11, 1), (12, 2), (20, 2)]
    loss_steps = {s for s, _ in run.series("diag/loss")}
    assert {s for s, _ in run.series("diag/alerts/grad_explosion")} <= loss_steps


# ---------------------------------------------------------------------------- item 3: settings
def test_bad_settings_listed_with_other_problems_before_training(tmp_path: Path) -> None:
    """A misspelled setting, a bad value and an unrelated problem: one ConfigError naming all three,
    raised by the constructor before anything is hooked or written."""
    model, opt = _model()
    out = tmp_path / "rec"
    sink = {"wandb": {"mode": "offline", "dir": str(tmp_path / "wb"),
                      "settings": {"consle": "off", "x_disable_stats": "sometimes", "x_save_requirements": False}}}
    with pytest.raises(ConfigError) as err:
        trackdiag.Diagnostics(model, opt, level="basic", sinks=["wandb"], output_dir=str(out), every=0, sink=sink)
    problems = err.value.problems
    assert len(problems) == 3, problems
    [typo] = [p for p in problems if p.startswith("diag.sink.wandb.settings.consle:")]
    assert "'off'" in typo and "console" in typo.split("close matches:")[1]
    [value] = [p for p in problems if p.startswith("diag.sink.wandb.settings.x_disable_stats:")]
    assert "'sometimes'" in value and "boolean" in value
    assert any(p.startswith("diag.every:") for p in problems)
    assert not out.exists() and not (tmp_path / "wb").exists()
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks

    with pytest.raises(ConfigError) as err2:  # the Hydra path: the same list
        trackdiag.Diagnostics.from_config({"level": "basic", "sinks": ["local", "wandb"], "every": 0, "sink": sink},
                                          model=model, optimizer=opt)
    assert err2.value.problems == problems


def test_valid_setting_accepted_and_used(tmp_path: Path) -> None:
    model, opt = _model()
    settings = {**LEAN, "run_id": "tdaxes01"}
    with trackdiag.Diagnostics(model, opt, level="basic", sinks=["wandb"], output_dir=str(tmp_path / "rec"),
                               sink={"wandb": {"mode": "offline", "dir": str(tmp_path), "settings": settings}}) as d:
        _train(d, model, opt, 3)
    [f] = settled_runs(tmp_path)
    assert f.name == "run-tdaxes01.wandb" and read_run(f).run["id"] == "tdaxes01"


def test_settings_without_wandb_installed_in_the_same_list(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    cfg = {"level": "basic", "sinks": ["local", "wandb"], "every": 0,
           "sink": {"wandb": {"mode": "offline", "settings": {"console": "off"}}}}
    with pytest.raises(ConfigError) as err:
        resolve(cfg)
    assert any(p.startswith("diag.sink.wandb.settings:") and "wandb is not installed" in p for p in err.value.problems)
    assert any(p.startswith("diag.every:") for p in err.value.problems)
    cfg["sink"]["wandb"]["mode"] = "disabled"  # a disabled sink uses no settings: nothing to check
    cfg["every"] = 1
    resolve(cfg)

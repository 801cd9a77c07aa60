"""trackdiag.integrations.transformers with the real Hugging Face Trainer (transformers 5.x) on CPU:
2-layer GPT-2 / BERT models built from configs (HF_HUB_OFFLINE, no download). References are what
the Trainer itself logs (``logging_steps=1``): its pre-clip ``grad_norm`` and its ``loss``."""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from _framework_util import fluent_mlflow_state_reset  # noqa: F401 (autouse fixture)
from _zoo_a import one_thread, quiet_probes
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import read_records

if TYPE_CHECKING:
    from transformers import Trainer

    from _hf_util import Recorder
    from trackdiag.integrations.transformers import DiagnosticsCallback


@pytest.fixture(autouse=True, scope="module")
def _hf() -> None:
    """transformers and what needs it, imported by this module's first test rather than at collection: importing
    transformers' Trainer costs ~2 s of CPU, paid by every xdist worker that collects the suite (issue 47)."""
    pytest.importorskip("transformers", reason="pip install 'trackdiag[transformers]'")
    global Trainer, TrainerCallback, Progressions, Recorder, accuracy, arguments, bert, gpt2, DiagnosticsCallback
    from transformers import Trainer, TrainerCallback

    from _hf_util import Progressions, Recorder, accuracy, arguments, bert, gpt2
    from trackdiag.integrations.transformers import DiagnosticsCallback


def train(tmp_path: Path, model: Any, *, cb: DiagnosticsCallback | None = None, arm_at: int | None = None,
          classify: bool = False, **args: Any) -> tuple[DiagnosticsCallback, Recorder, Trainer]:
    cb = cb or DiagnosticsCallback("advanced", output_dir=str(tmp_path / "run"), sinks=["local"], probes=quiet_probes())
    rec = Recorder(arm_at)
    trainer = Trainer(model=model, args=arguments(tmp_path, **args), train_dataset=Progressions(256, 0, classify),
                      eval_dataset=Progressions(32, 1, classify), callbacks=[rec, cb],
                      compute_metrics=accuracy if classify else None)
    with one_thread():
        trainer.train()
    return cb, rec, trainer


def points(out: Path, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == key}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_grad_norm_and_loss_equal_the_trainers_own_per_step_logs(tmp_path: Path, precision: str) -> None:
    cb, rec, trainer = train(tmp_path, gpt2(), gradient_accumulation_steps=2, max_grad_norm=0.5, max_steps=10,
                             eval_strategy="steps", eval_steps=8, bf16=precision == "bf16")
    assert cb.alerts == [] and cb.summary()["steps"] == trainer.state.global_step == 10
    norms, loss = points(tmp_path / "run", "diag/grad/global_norm"), points(tmp_path / "run", "diag/loss")
    assert sorted(norms) == sorted(loss) == sorted(rec.logs) == list(range(10))
    assert any(log["grad_norm"] > 0.5 for log in rec.logs.values())  # clipped in the loop: the series is pre-clip
    for step, log in rec.logs.items():
        assert norms[step] == pytest.approx(log["grad_norm"], rel=1e-5), step
        assert loss[step] == pytest.approx(log["loss"], rel=1e-5), step  # sum of the 2 micro-batches' shares
    evals = points(tmp_path / "run", "diag/eval/loss")  # at step 8 and at the end
    assert evals == {s: pytest.approx(e["eval_loss"], rel=1e-6) for s, e in rec.evals.items()} and 7 in evals


def test_nan_loss_the_trainer_hides_is_caught_at_its_step_with_the_module(tmp_path: Path) -> None:
    cb = DiagnosticsCallback("advanced", every=4, output_dir=str(tmp_path / "run"), sinks=["local"],
                             probes=quiet_probes(), rules={"nonfinite_loss": {"action": "stop"}})
    cb, rec, trainer = train(tmp_path, gpt2(), cb=cb, arm_at=9, max_steps=20, max_grad_norm=1.0)
    assert rec.logs[9]["loss"] == 0.0 and math.isnan(rec.logs[9]["grad_norm"])  # logging_nan_inf_filter
    alert = next(a for a in cb.alerts if a.kind == "nonfinite_loss")
    assert alert.step == 9 and alert.where.startswith("transformer.h.1.mlp.act"), alert
    assert math.isnan(points(tmp_path / "run", "diag/loss")[9])
    assert 9 < trainer.state.global_step <= 13 < 20  # stopped after the first logging step at or after 9


def test_a_loss_the_model_does_not_return_is_reported_missing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
        return torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))

    cb = DiagnosticsCallback("basic", every=2, output_dir=str(tmp_path / "run"), sinks=["local"])
    rec = Recorder()
    trainer = Trainer(model=gpt2(), args=arguments(tmp_path, max_steps=4), train_dataset=Progressions(64),
                      callbacks=[rec, cb], compute_loss_func=loss_func)
    with caplog.at_level(logging.WARNING, "trackdiag"), one_thread():
        trainer.train()
    assert sum("no loss for this step" in r.message for r in caplog.records) == 1
    assert not points(tmp_path / "run", "diag/loss")
    norms = points(tmp_path / "run", "diag/grad/global_norm")
    assert norms[3] == pytest.approx(rec.logs[3]["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_a_run_that_dies_of_an_exception_is_closed_failed_at_exit(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")

    class Boom(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                raise RuntimeError("planted")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "boom")
    cb = DiagnosticsCallback("basic", output_dir=str(tmp_path / "run"), sink={"mlflow": {"delivery": "thread"}})
    trainer = Trainer(model=gpt2(), args=arguments(tmp_path, report_to=["mlflow"]), train_dataset=Progressions(64),
                      callbacks=[Boom(), cb])
    with pytest.raises(RuntimeError, match="planted") as err, one_thread():
        trainer.train()
    assert mlflow.active_run() is not None  # the Trainer's MLflowCallback never reached on_train_end
    monkeypatch.setattr(sys, "last_value", err.value, raising=False)  # what the interpreter sets for an uncaught one
    cb._at_exit()  # the atexit handler, called here
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "FAILED"
    assert cb.summary()["steps"] == 3 and mlflow.active_run() is None
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # the only run
    assert run.info.status == "FAILED" and "diag/loss" in run.data.metrics


@pytest.mark.slow
def test_report_to_mlflow_one_run_holds_the_trainers_metrics_and_diag(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)  # the Trainer's MLflowCallback logs to the fluent tracking URI
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    cb = DiagnosticsCallback("advanced", every=4, output_dir=str(tmp_path / "run"), probes=quiet_probes(),
                             sink={"mlflow": {"delivery": "thread"}})
    train(tmp_path, bert(), cb=cb, classify=True, report_to=["mlflow"], max_steps=8, gradient_accumulation_steps=2,
          eval_strategy="steps", eval_steps=4)
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # the only run
    assert {"loss", "grad_norm", "eval_loss", "eval_accuracy", "diag/loss", "diag/grad/global_norm",
            "diag/eval/loss", "diag/eval/accuracy"} <= set(run.data.metrics)
    assert run.info.status == "FINISHED" and run.data.tags["trackdiag.level"] == "advanced"
    assert mlflow.active_run() is None and cb.alerts == []
    grad = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "grad_norm")}
    diag = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "diag/grad/global_norm")}
    assert sorted(diag) == [s - 1 for s in sorted(grad)] == list(range(8))  # the Trainer stamps after counting
    assert all(diag[s - 1] == pytest.approx(grad[s], rel=1e-5) for s in grad)


@pytest.mark.slow
def test_report_to_wandb_one_offline_run_holds_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from wandb_reader import read_run, settled_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf")
    cb = DiagnosticsCallback("basic", every=2, output_dir=str(tmp_path / "run"))
    train(tmp_path, gpt2(), cb=cb, report_to=["wandb"], max_steps=6)
    wandb.finish()
    (path,) = settled_runs(tmp_path)  # one run file anywhere: the sink started no run of its own
    keys = set().union(*map(set, read_run(path).history))
    assert {"train/loss", "train/grad_norm", "diag/loss", "diag/grad/global_norm"} <= keys


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 AMP with a GradScaler needs CUDA (accelerate ignores "
                                                          "fp16 on CPU)")
def test_fp16_scaler_norm_is_unscaled(tmp_path: Path) -> None:
    cb, rec, trainer = train(tmp_path, gpt2(), fp16=True, use_cpu=False, max_steps=6, max_grad_norm=0.5)
    assert cb.diag._ctx.scaler is trainer.accelerator.scaler is not None
    norms = points(tmp_path / "run", "diag/grad/global_norm")
    for step, log in rec.logs.items():
        if math.isfinite(log["grad_norm"]):  # a skipped (overflowing) step logs inf/nan on both sides
            assert norms[step] == pytest.approx(log["grad_norm"], rel=1e-4), step


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ConfigError, match="diag.every"):
        DiagnosticsCallback(every=0)

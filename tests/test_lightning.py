"""trackdiag.integrations.lightning with the real Lightning 2.x Trainer on CPU: an MLP on
scikit-learn's digits (no download). References are computed inside the same fit by a callback
that runs where Lightning's own clipping does (``on_before_optimizer_step``, after unscaling)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

import _warm as warm
from _framework_util import fluent_mlflow_state_reset  # noqa: F401 (autouse fixture)
from _zoo_a import digits, one_thread, quiet_probes
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import read_records
from _clip import clip_checked

if TYPE_CHECKING:
    from _lightning_util import DigitsNet
    from trackdiag.integrations.lightning import DiagnosticsCallback


@pytest.fixture(autouse=True, scope="module")
def _lightning() -> None:
    """Lightning and what needs it, imported by this module's first test rather than at collection (see
    ``_lightning_util``)."""
    global pl, DigitsNet, Reference, DiagnosticsCallback
    pl = pytest.importorskip("lightning.pytorch", reason="pip install 'trackdiag[lightning]'")
    from _lightning_util import DigitsNet, Reference
    from trackdiag.integrations.lightning import DiagnosticsCallback

TRAINER = dict(accelerator="cpu", devices=1, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, num_sanity_val_steps=0)


def loaders(batch_size: int = 32) -> tuple[Any, Any]:
    xtr, ytr, xva, yva = digits()
    train = torch.utils.data.TensorDataset(xtr[:512], ytr[:512])
    return (torch.utils.data.DataLoader(train, batch_size=batch_size),
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xva, yva), batch_size=128))


def fit(tmp_path: Path, *, steps: int = 16, callbacks: tuple[Any, ...] = (), level: str = "advanced",
        model: DigitsNet | None = None, **trainer: Any) -> tuple[DiagnosticsCallback, Any, DigitsNet]:
    cb = next((c for c in callbacks if isinstance(c, DiagnosticsCallback)), None) or DiagnosticsCallback(
        level, every=4, output_dir=str(tmp_path / "run"), sinks=["local"], probes=quiet_probes())
    model = model or DigitsNet()
    tr = pl.Trainer(**{**TRAINER, "max_steps": steps, "logger": False, "val_check_interval": 8, **trainer},
                    callbacks=[cb, *[c for c in callbacks if c is not cb]])
    with one_thread():
        tr.fit(model, *loaders())
    return cb, tr, model


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One sqlite MLflow store for the module (creating its schema costs seconds); one experiment per test."""
    pytest.importorskip("mlflow")
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


def runs_of(uri: str, experiment: str) -> list[Any]:
    """The runs of ``experiment``; fails if the store holds a run outside this module's experiments
    (a second run trackdiag would have started lands in an experiment of its own)."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    used = {e.name for e in client.search_experiments() if client.search_runs([e.experiment_id])}
    assert used <= {"lit-ok", "lit-boom"}, used  # ("user-exp" is active in one test, and stays empty)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def points(out: Path, key: str) -> dict[int, float]:
    return {s: v for r in read_records(out) for k, s, v in r.points() if k == key}


def test_accumulation_loss_and_preclip_norm_per_real_optimizer_step(tmp_path: Path) -> None:
    ref = Reference()
    cb, tr, model = fit(tmp_path, steps=12, callbacks=(ref,), accumulate_grad_batches=4, gradient_clip_val=0.15)
    assert cb.alerts == [] and tr.global_step == cb.summary()["steps"] == 12
    norms = points(tmp_path / "run", "diag/grad/global_norm")
    assert sorted(norms) == sorted(ref.norms) == list(range(12))
    assert any(v > 0.15 for v in ref.norms.values())  # Lightning really clipped: the series is pre-clip
    for step, v in ref.norms.items():
        assert norms[step] == pytest.approx(v, rel=1e-5), step
    loss = points(tmp_path / "run", "diag/loss")  # mean of the step's 4 micro-batch losses
    for step in range(12):
        assert loss[step] == pytest.approx(sum(model.losses[4 * step:4 * step + 4]) / 4, rel=1e-5), step
    evals = points(tmp_path / "run", "diag/eval/loss")
    assert sorted(evals) == ref.evals == sorted(points(tmp_path / "run", "diag/eval/acc")) and len(ref.evals) == 6
    assert evals[ref.evals[-1]] == pytest.approx(float(tr.callback_metrics["val_loss"]), rel=1e-6)


def test_manual_optimization_gan_reads_each_network_at_its_own_step(tmp_path: Path) -> None:
    """Lightning's GAN template: ``automatic_optimization = False``, toggle_optimizer / manual_backward /
    step for G, then for D, in one LightningModule. The step's pre-clip norm is the norm of G's gradient at
    G's step and D's at D's (each network's pass merged in at its own optimizer's step), and neither network
    looks untrained (before: D's gradient was read at G's step, where it had none: ``stale_params``)."""
    from torch.nn import functional as F

    class GAN(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.generator = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.Tanh())
            self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1), nn.Sigmoid())
            self.norms: list[float] = []

        def training_step(self, batch: Any) -> None:
            imgs = batch[0] * 2 - 1
            opt_g, opt_d = self.optimizers()
            z = torch.randn(imgs.shape[0], 16)
            ones, zeros = torch.ones(len(imgs), 1), torch.zeros(len(imgs), 1)
            self.toggle_optimizer(opt_g)
            self.manual_backward(F.binary_cross_entropy(self.discriminator(self.generator(z)), ones))
            ng = clip_checked(self.generator.parameters(), math.inf).item()
            opt_g.step()
            opt_g.zero_grad()
            self.untoggle_optimizer(opt_g)
            self.toggle_optimizer(opt_d)
            fake = self.generator(z).detach()
            d_loss = (F.binary_cross_entropy(self.discriminator(imgs), ones) + F.binary_cross_entropy(self.discriminator(fake), zeros)) / 2
            self.manual_backward(d_loss)
            nd = clip_checked(self.discriminator.parameters(), math.inf).item()
            opt_d.step()
            opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
            self.norms.append(math.hypot(ng, nd))
            return d_loss

        def configure_optimizers(self) -> Any:
            return [torch.optim.Adam(self.generator.parameters(), 2e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.discriminator.parameters(), 2e-4, betas=(0.5, 0.999))]

    xtr, ytr, _, _ = digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=64, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = GAN()
    cb = DiagnosticsCallback("advanced", every=5, output_dir=str(tmp_path / "run"), sinks=["local"], probes=quiet_probes())
    with one_thread():
        pl.Trainer(**{**TRAINER, "max_steps": 120, "logger": False}, callbacks=[cb]).fit(model, loader)
    norms = points(tmp_path / "run", "diag/grad/global_norm")
    assert len(norms) == len(model.norms) == 60  # global_step counts both optimizers' steps: one diagnostics step per batch
    assert [norms[s] for s in sorted(norms)] == pytest.approx(model.norms, rel=1e-5)
    assert [a for a in cb.alerts if a.kind == "stale_params"] == []


def test_16_mixed_scaler_passed_and_norm_unscaled(tmp_path: Path) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    ref = Reference()
    cb, tr, _ = fit(tmp_path, steps=8, callbacks=(ref,), plugins=[MixedPrecision("16-mixed", "cpu")],
                    gradient_clip_val=1.0)
    scaler = tr.precision_plugin.scaler
    assert cb.diag._ctx.scaler is scaler and cb.alerts == []
    assert points(tmp_path / "run", "diag/amp/scale")[0] == 65536.0  # the plugin's scaler, read at step 0
    norms = points(tmp_path / "run", "diag/grad/global_norm")
    assert sorted(norms) == sorted(ref.norms) == list(range(8))
    for step, v in ref.norms.items():  # the backward left them 65536x larger: the tap divided by the scale
        assert norms[step] == pytest.approx(v, rel=1e-5), step


def test_nan_in_a_named_module_alerts_at_its_step_and_stops_the_trainer(tmp_path: Path) -> None:
    cb = DiagnosticsCallback("advanced", every=4, output_dir=str(tmp_path / "run"), sinks=["local"],
                             probes=quiet_probes(), rules={"nonfinite_loss": {"action": "stop"}})
    cb, tr, _ = fit(tmp_path, steps=30, callbacks=(cb, Reference(arm_at=9)))
    alert = next(a for a in cb.alerts if a.kind == "nonfinite_loss")
    assert alert.step == 9 and alert.where.startswith("body.4"), alert
    # judged at the first logging step at or after 9 (every=4: by 12), stopped right after it
    assert tr.should_stop and 9 < tr.global_step <= 13 < 30


@pytest.mark.slow
def test_mlflow_logger_one_run_holds_both_and_is_left_to_lightning(tmp_path: Path, store: str) -> None:
    import mlflow
    from lightning.pytorch.loggers import MLFlowLogger

    mlflow.set_tracking_uri(store)
    mine = mlflow.set_experiment("user-exp").experiment_id  # the user's active experiment is another one
    cb = DiagnosticsCallback("advanced", every=4, output_dir=str(tmp_path / "run"), probes=quiet_probes(),
                             sink={"mlflow": {"delivery": "thread"}})
    fit(tmp_path, steps=8, callbacks=(cb,), logger=MLFlowLogger("lit-ok", tracking_uri=store), log_every_n_steps=2)
    assert os.environ["MLFLOW_EXPERIMENT_ID"] == mine  # and stays active
    (run,) = runs_of(store, "lit-ok")
    assert {"train_loss", "val_loss", "diag/loss", "diag/grad/global_norm", "diag/eval/loss", "diag/eval/acc"} \
        <= set(run.data.metrics)
    assert run.info.status == "FINISHED" and run.data.tags["trackdiag.level"] == "advanced"
    assert run.data.params == {"lr": "0.1"}  # Lightning's hyperparameters, not written twice
    assert mlflow.active_run() is None  # the fluent run trackdiag joined through is gone


@pytest.mark.slow
def test_exception_ends_the_session_and_the_run_failed(tmp_path: Path, store: str) -> None:
    import mlflow
    from lightning.pytorch.loggers import MLFlowLogger

    class Boom(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                raise RuntimeError("planted")

    cb = DiagnosticsCallback("basic", output_dir=str(tmp_path / "run"), sink={"mlflow": {"delivery": "thread"}})
    with pytest.raises(RuntimeError, match="planted"):
        fit(tmp_path, steps=8, callbacks=(cb, Boom()), logger=MLFlowLogger("lit-boom", tracking_uri=store))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "FAILED"
    (run,) = runs_of(store, "lit-boom")
    assert run.info.status == "FAILED" and mlflow.active_run() is None


@pytest.mark.slow
def test_wandb_logger_one_offline_run_holds_both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    from lightning.pytorch.loggers import WandbLogger
    from wandb_reader import read_run, settled_runs

    monkeypatch.setenv("WANDB_MODE", "offline")
    cb = DiagnosticsCallback("basic", every=2, output_dir=str(tmp_path / "run"), probes=quiet_probes())
    fit(tmp_path, steps=8, callbacks=(cb,), logger=WandbLogger(project="lit", save_dir=str(tmp_path), offline=True),
        log_every_n_steps=2)
    wandb.finish()
    (path,) = settled_runs(tmp_path)  # one run file anywhere: the sink started no run of its own
    keys = set().union(*map(set, read_run(path).history))
    assert {"train_loss", "val_loss", "diag/loss", "diag/grad/global_norm", "diag/eval/loss"} <= keys


def test_checkpoint_resume_continues_the_step_count(tmp_path: Path) -> None:
    ckpt = tmp_path / "last.ckpt"
    cb, tr, model = fit(tmp_path, steps=6)
    tr.save_checkpoint(ckpt)
    again = DiagnosticsCallback("advanced", every=4, output_dir=str(tmp_path / "run2"), sinks=["local"], probes=quiet_probes())
    tr2 = pl.Trainer(**{**TRAINER, "max_steps": 10, "logger": False}, callbacks=[again])
    with one_thread():
        tr2.fit(DigitsNet(), loaders()[0], ckpt_path=str(ckpt))
    assert again.summary()["steps"] == tr2.global_step == 10
    assert min(points(tmp_path / "run2", "diag/loss")) == 6


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ConfigError, match="diag.every"):
        DiagnosticsCallback(every=0)
    with pytest.raises(ValueError, match="monitor"):
        DiagnosticsCallback(monitor="")


@pytest.mark.slow
def test_ddp_two_processes_one_run_and_a_collective_stop(tmp_path: Path) -> None:
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])  # this checkout first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "MLFLOW_TRACKING_URI": uri}
    worker = Path(__file__).with_name("_lightning_ddp_worker.py")
    proc = warm.popen([sys.executable, str(worker), str(tmp_path), uri], env=env, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                      start_new_session=True)  # Lightning forks rank 1
    try:
        out = proc.communicate(timeout=150)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:  # NaN on rank 1 at step 5, judged by both ranks at logging step 8: both stop there
        assert (r["global_step"], r["diag_steps"], r["should_stop"]) == (9, 9, True), r
        alert = next(a for a in r["alerts"] if a["kind"] == "nonfinite_loss")
        assert (alert["step"], alert["where"]) == (5, "rank 1")
    assert [p.parent.name for p in tmp_path.rglob("records.jsonl")] == ["run"]
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # the only run
    assert {"train_loss", "diag/loss", "diag/alerts/nonfinite_loss"} <= set(run.data.metrics)
    assert run.data.metrics["diag/dist/world_size"] == 2


def test_gradient_clip_val_is_answered_from_the_tap_and_trains_the_same(tmp_path: Path) -> None:
    """Lightning clips with ``torch.nn.utils.clip_grad_norm_`` over the optimizer's parameters (a generator): under
    the callback the call is answered from the gradient tap's norms (``trackdiag.capture.clip_serve``) and the
    weights after 16 clipped steps are the bare Trainer's, bit for bit."""
    from trackdiag.capture import clip_serve

    def run(watched: bool) -> Any:
        torch.manual_seed(0)
        model = DigitsNet()
        cbs = [DiagnosticsCallback("basic", every=4, output_dir=str(tmp_path / "run"), sinks=["local"],
                                   probes=quiet_probes())] if watched else []
        tr = pl.Trainer(**{**TRAINER, "max_steps": 16, "logger": False, "val_check_interval": 8,
                           "gradient_clip_val": 0.15}, callbacks=cbs)
        with one_thread():
            tr.fit(model, *loaders())
        return model

    bare = run(False)
    before = clip_serve.counts["served"]
    watched = run(True)
    assert clip_serve.counts["served"] - before >= 12
    assert all(torch.equal(p, q) for p, q in zip(bare.parameters(), watched.parameters()))

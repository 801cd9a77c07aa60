"""Optuna sweeps that stop their own bad trials (issue 46): a 16-trial study of the example app
(``examples/train.py`` with ``examples/conf``, its real training loop) over the SGD learning rate,
whose top explodes, stored in a real PostgreSQL (Optuna's RDB storage, as several machines share it).

The same grid runs twice: without stopping (trackdiag only watching: which trials raise a critical
alert, at which step) and with :func:`trackdiag.integrations.optuna.watch_trial`. Every trial that
exploded is stopped within 10 steps of its first critical alert and recorded PRUNED with the alert as
the reason; no healthy trial is stopped and each returns the same value; the best trial is the same.
"""
from __future__ import annotations

import importlib.util
import math
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from _postgres import Postgres, skip_reason

optuna = pytest.importorskip("optuna")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")]

REPO = Path(__file__).resolve().parents[1]
STEPS = 40
LRS = [float(f"{10 ** (-3 + 8 * i / 15):.4g}") for i in range(16)]  # 1e-3 ... 1e5, log-spaced: NaN from ~1e4 up


@pytest.fixture(scope="module")
def storage() -> Iterator[str]:
    pg = Postgres()
    pg.start()
    try:
        yield pg.create_db("optuna").replace("postgresql://", "postgresql+psycopg://")  # psycopg 3 (MLflow's)
    finally:
        pg.stop()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread, as a sweep's job gets on a cluster (2 threads spin against other work here)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def example_main() -> Any:
    """The example app's task function itself (under its ``@hydra.main``)."""
    spec = importlib.util.spec_from_file_location("example_train", REPO / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.main.__wrapped__


def sweep(storage: str, name: str, root: Path, stop: bool) -> tuple[Any, dict[float, list[Any]], float]:
    """Run the 16-trial grid; returns (the study as reloaded from the storage, lr -> alerts of its
    session, wall seconds)."""
    from hydra import compose, initialize_config_dir

    from trackdiag.core import watchers
    from trackdiag.integrations.optuna import watch_trial

    main = example_main()
    alerts: dict[float, list[Any]] = {}

    def objective(trial: Any) -> float:
        lr = trial.suggest_float("lr", LRS[0], LRS[-1], log=True)
        with initialize_config_dir(str(REPO / "examples" / "conf"), version_base=None):
            cfg = compose("config", overrides=[
                "+diag=basic", "diag.sinks=[local]", "diag.every=5", "diag.budget=null", f"steps={STEPS}", "eval_every=10",
                "optimizer.name=sgd", f"optimizer.lr={lr}", f"diag.output_dir={root / name / str(trial.number)}"])
        seen: list[Any] = []
        watchers.watch(seen.append)
        try:
            if not stop:
                return float(main(cfg))
            with watch_trial(trial, planned_steps=STEPS):
                return float(main(cfg))
        finally:
            watchers.unwatch(seen.append)
            alerts[lr] = seen[0].alerts if seen else []

    study = optuna.create_study(study_name=name, storage=storage, pruner=optuna.pruners.NopPruner(),
                                sampler=optuna.samplers.GridSampler({"lr": LRS}, seed=0))
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=len(LRS))
    wall = time.perf_counter() - t0
    return optuna.load_study(study_name=name, storage=storage), alerts, wall


def first_critical(alerts: list[Any]) -> Any:
    return next((a for a in alerts if a.severity == "critical"), None)


def test_sweep_stops_exploding_trials(storage: str, tmp_path: Path, one_thread: None,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    free, free_alerts, free_wall = sweep(storage, "free", tmp_path, stop=False)
    stopped, stop_alerts, stop_wall = sweep(storage, "stopped", tmp_path, stop=True)

    exploded = {lr for lr, a in free_alerts.items() if first_critical(a) is not None}
    assert exploded and max(LRS) in exploded, {lr: [(a.kind, a.severity) for a in v] for lr, v in free_alerts.items()}
    assert len(stopped.trials) == len(free.trials) == len(LRS)
    by_lr = {t.params["lr"]: t for t in stopped.trials}
    free_by_lr = {t.params["lr"]: t for t in free.trials}
    for lr, t in by_lr.items():
        if lr in exploded:
            first = first_critical(free_alerts[lr])
            assert t.state == optuna.trial.TrialState.PRUNED, (lr, t.state)
            assert t.user_attrs["trackdiag.stopped"] is True
            assert t.user_attrs["trackdiag.stop.severity"] == "critical"
            assert t.user_attrs["trackdiag.stop.kind"] == first.kind
            assert 0 <= t.user_attrs["trackdiag.stop.stop_step"] - first.step <= 10, (lr, t.user_attrs, first)
            assert t.user_attrs["trackdiag.stop.steps_saved"] == STEPS - t.user_attrs["trackdiag.stop.steps_run"] > 0
        else:  # healthy: never stopped, same result as without stopping
            assert t.state == optuna.trial.TrialState.COMPLETE, (lr, t.state, t.user_attrs)
            assert "trackdiag.stopped" not in t.user_attrs
            assert t.value == pytest.approx(free_by_lr[lr].value, rel=1e-6, nan_ok=True)
    assert stopped.best_trial.params == free.best_trial.params
    assert math.isfinite(stopped.best_value)
    # intermediate values (the training loss at logging steps) reached the trials, for Optuna's pruners
    healthy = [t for lr, t in by_lr.items() if lr not in exploded]
    assert all(sorted(t.intermediate_values) == list(range(0, STEPS, 5)) for t in healthy)
    saved = sum(t.user_attrs.get("trackdiag.stop.steps_saved", 0) for t in stopped.trials)
    # the comparison, read from the study on PostgreSQL (each trial joined to its run), lists the stopped trials
    from trackdiag.compare import compare

    comparison = compare(f"optuna:{storage}#stopped")
    listed = {r.trial["trial"] for r in comparison.runs if r.trial and r.trial.get("stopped")}
    assert listed == {t.number for t in stopped.trials if t.state == optuna.trial.TrialState.PRUNED}, listed
    assert comparison.stops["stopped"] == len(exploded) and comparison.stops["steps_saved"] == saved
    print(f"\n16 trials x {STEPS} steps: {len(exploded)} exploded; stopping saved {saved} trial-steps; "
          f"wall {free_wall:.1f}s without stopping, {stop_wall:.1f}s with")

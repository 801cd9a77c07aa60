"""Benchmark: an Optuna sweep of the example app with and without trackdiag stopping its bad trials.

The example app's task function (``examples/train.py`` with ``examples/conf``) is the objective: a
``--trials`` grid over the SGD learning rate, log-spaced from ``--lr-min`` to ``--lr-max`` (NaN from
~1e4 up), ``--steps`` steps each, ``+diag=basic`` (local record only, ``every=5``), one intra-op
thread. The same grid runs twice in one storage (``--storage``, default in-memory; e.g.
``postgresql+psycopg://user@host/db``): without stopping (trackdiag only watching) and with
:func:`trackdiag.integrations.optuna.watch_trial`. Printed: trials pruned, trial-steps run and saved,
wall time of each sweep and the saving, the best trial of each.

    python benchmarks/optuna_stop.py [--trials 16] [--steps 200] [--storage URL]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def run(args: argparse.Namespace, name: str, stop: bool, root: Path) -> tuple[Any, float]:
    """One sweep; returns (the study, wall seconds)."""
    import optuna
    from hydra import compose, initialize_config_dir

    from trackdiag.integrations.optuna import watch_trial

    spec = importlib.util.spec_from_file_location("example_train", REPO / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    main = mod.main.__wrapped__
    n = args.trials
    lrs = [float(f"{args.lr_min * (args.lr_max / args.lr_min) ** (i / max(n - 1, 1)):.4g}") for i in range(n)]

    def objective(trial: Any) -> float:
        lr = trial.suggest_float("lr", lrs[0], lrs[-1], log=True)
        with initialize_config_dir(str(REPO / "examples" / "conf"), version_base=None):
            cfg = compose("config", overrides=[
                "+diag=basic", "diag.sinks=[local]", "diag.every=5", "+diag.sink.console.enabled=false",
                f"steps={args.steps}", "eval_every=10", "optimizer.name=sgd", f"optimizer.lr={lr}",
                f"diag.output_dir={root / name / str(trial.number)}"])
        if not stop:
            return float(main(cfg))
        with watch_trial(trial, planned_steps=args.steps):
            return float(main(cfg))

    study = optuna.create_study(study_name=name, storage=args.storage, pruner=optuna.pruners.NopPruner(),
                                sampler=optuna.samplers.GridSampler({"lr": lrs}, seed=0))
    t0 = time.perf_counter()
    study.optimize(objective, n_trials=n)
    return study, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr-min", type=float, default=1e-3)
    ap.add_argument("--lr-max", type=float, default=1e5)
    ap.add_argument("--storage", default=None, help="Optuna storage URL (default: in-memory)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import optuna
    import torch

    torch.set_num_threads(1)
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="optuna-stop-") as tmp:
        os.chdir(tmp)
        tag = str(int(time.time()))
        free, free_wall = run(args, f"free-{tag}", False, Path(tmp))
        stopped, stop_wall = run(args, f"stopped-{tag}", True, Path(tmp))
    planned = args.trials * args.steps
    pruned = [t for t in stopped.trials if t.user_attrs.get("trackdiag.stopped")]
    ran = planned - sum(t.user_attrs.get("trackdiag.stop.steps_saved", 0) for t in pruned)
    lines = [
        f"{args.trials} trials x {args.steps} steps, SGD lr {args.lr_min:g}..{args.lr_max:g} (log grid)",
        f"stopped (pruned on a critical alert): {len(pruned)}: "
        + ", ".join(f"#{t.number} lr={t.params['lr']:g} {t.user_attrs['trackdiag.stop.kind']}"
                    f"@{t.user_attrs['trackdiag.stop.stop_step']}" for t in pruned),
        f"trial-steps: {planned} without stopping, {ran} with ({planned - ran} saved, "
        f"{100 * (planned - ran) / planned:.1f}%)",
        f"wall: {free_wall:.1f} s without stopping, {stop_wall:.1f} s with ({free_wall - stop_wall:+.1f} s saved)",
        f"best trial: lr={free.best_params['lr']:g} ({free.best_value:.4f}) without, "
        f"lr={stopped.best_params['lr']:g} ({stopped.best_value:.4f}) with",
    ]
    sys.stdout.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

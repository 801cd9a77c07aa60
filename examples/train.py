"""A small, real Hydra training app: an MLP on scikit-learn's bundled digits data.

It is the loop trackdiag must fit (grad accumulation -> unscale -> clip -> step -> update ->
zero_grad) and it can plant faults (``fault=nan_input``, ``fault=lr_explode``, ``fault=crash``) so every alert
can be seen firing. ``python examples/train.py +diag=advanced``. At the end trackdiag prints where
the results are and how to look at them (the local record, the MLflow run's page).
"""
from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

import trackdiag

log = logging.getLogger("train")
ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1,797 8x8 images, labels 0-9), read from its CSV file as
    ``sklearn.datasets.load_digits(return_X_y=True)`` reads it, without importing scikit-learn (~1.3 s at start-up)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the example reads scikit-learn's digits: pip install scikit-learn")
    data = np.loadtxt(Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz", delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def load_data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as float features in [0, 1]; a fixed 80/20 train/val split."""
    x, y = load_digits()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(x))
    return x[perm[:cut]], y[perm[:cut]], x[perm[cut:]], y[perm[cut:]]


def build_model(cfg: DictConfig) -> nn.Module:
    layers: list[nn.Module] = []
    width = 64
    for _ in range(cfg.model.depth):
        layers += [nn.Linear(width, cfg.model.hidden), ACTIVATIONS[cfg.model.activation]()]
        width = cfg.model.hidden
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def build_optimizer(cfg: DictConfig, model: nn.Module) -> torch.optim.Optimizer:
    o = cfg.optimizer
    if o.name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    return torch.optim.Adam(model.parameters(), lr=o.lr, weight_decay=o.weight_decay)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    torch.manual_seed(cfg.seed)
    xtr, ytr, xva, yva = load_data(cfg.seed)
    model = build_model(cfg)
    opt = build_optimizer(cfg, model)
    scaler = torch.amp.GradScaler("cpu", enabled=cfg.amp)
    diag = trackdiag.Diagnostics.from_config(cfg.get("diag"), model=model, optimizer=opt, scaler=scaler, hparams=cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    val_loss = float("nan")
    with diag:
        for step in range(cfg.steps):
            if cfg.fault == "crash" and step == cfg.fault_step:  # a job that dies (sweep comparison tests)
                raise RuntimeError(f"planted crash at step {step}")
            if cfg.fault == "lr_explode" and step == cfg.fault_step:
                for g in opt.param_groups:
                    g["lr"] = 50.0
            for _ in range(cfg.accumulate):
                idx = torch.randint(0, len(xtr), (cfg.batch_size,), generator=gen)
                x, y = xtr[idx], ytr[idx]
                if cfg.fault == "nan_input" and step == cfg.fault_step:
                    x = x.clone()
                    x[0, 0] = float("nan")
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.amp):
                    out = model(x)
                    loss = F.cross_entropy(out.float(), y)
                scaler.scale(loss / cfg.accumulate).backward()
            scaler.unscale_(opt)
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if diag.step(loss, outputs=out, batch=x):
                log.warning("trackdiag asked to stop at step %d", step)
                break
            if (step + 1) % cfg.eval_every == 0:
                with torch.no_grad():
                    logits = model(xva)
                    val_loss = F.cross_entropy(logits, yva).item()
                    acc = (logits.argmax(1) == yva).float().mean().item()
                diag.log_eval(loss=val_loss, accuracy=acc)
                log.info("step %d  train %.4f  val %.4f  acc %.3f", step, loss.item(), val_loss, acc)
    return val_loss


if __name__ == "__main__":
    main()

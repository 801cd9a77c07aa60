"""``trackdiag landscape CHECKPOINT --batch BATCH``: a loss landscape of a saved model, as PNG + JSON.

CHECKPOINT is either a whole model saved with ``torch.save(model, path)``, or a state dict (or a
dict holding one under ``model``/``state_dict``/``model_state_dict``) together with
``--factory package.module:function`` that builds the model. BATCH is ``torch.save((inputs,
targets), path)`` (or a dict with ``x``/``y`` or ``inputs``/``targets``). Both files are unpickled:
load only files you trust.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trackdiag.core.errors import TrackdiagError

#: the keys of ``forensics.landscape.LOSSES`` (tests/test_cli_startup.py checks them): that module imports
#: torch, which every other subcommand does without
LOSS_NAMES = ("cross_entropy", "mse")

_STATE_KEYS = ("model", "state_dict", "model_state_dict")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("landscape", help="plot the loss landscape of a saved model around its weights")
    p.add_argument("checkpoint", type=Path, help="torch.save'd model, or a state dict (with --factory)")
    p.add_argument("--batch", type=Path, required=True, help="torch.save'd (inputs, targets) to score the model on")
    p.add_argument("--factory", help="module:function that returns the model, for a state-dict checkpoint")
    p.add_argument("--loss", choices=LOSS_NAMES, default="cross_entropy", help="loss(model(inputs), targets)")
    p.add_argument("--dims", type=int, choices=(1, 2), default=2, help="1-D slice or 2-D contour (default 2)")
    p.add_argument("--steps", type=int, default=21, help="grid points per axis, rounded down to odd (default 21)")
    p.add_argument("--span", type=float, default=1.0, help="grid covers [-span, span] (default 1.0)")
    p.add_argument("--max-evals", type=int, default=None, help="cap on forward passes (shrinks the grid)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random directions (default 0)")
    p.add_argument("--device", default="cpu", help="device to evaluate on (default cpu)")
    p.add_argument("--out", type=Path, default=Path("."), help="output directory (default: .)")
    p.add_argument("--name", default="landscape", help="file stem of the outputs (default: landscape)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def load_model(checkpoint: Path, factory: str | None, device: str) -> Any:
    """The model in ``checkpoint`` (a whole module, or a state dict built with ``factory``) on ``device``."""
    import torch
    from torch import nn

    obj = torch.load(checkpoint, map_location=device, weights_only=False)
    if isinstance(obj, nn.Module):
        return obj.to(device)
    if not isinstance(obj, dict):
        raise TrackdiagError(f"{checkpoint}: expected a model or a state dict, got {type(obj).__name__}")
    if factory is None:
        raise TrackdiagError(f"{checkpoint} holds a state dict: pass --factory module:function that builds the model")
    from trackdiag.core.registry import resolve

    try:
        build = resolve(factory)
    except (ImportError, AttributeError, ValueError) as exc:
        raise TrackdiagError(f"--factory {factory!r}: cannot import it: {exc}") from exc
    state = next((obj[k] for k in _STATE_KEYS if isinstance(obj.get(k), dict)), obj)
    model = build()
    model.load_state_dict(state)
    return model.to(device)


def load_batch(path: Path, device: str) -> tuple[Any, Any]:
    """``(inputs, targets)`` from ``path``, moved to ``device``."""
    import torch

    obj = torch.load(path, map_location=device, weights_only=False)
    if isinstance(obj, dict):
        pair = next(((obj[a], obj[b]) for a, b in (("x", "y"), ("inputs", "targets")) if a in obj and b in obj), None)
        if pair is None:
            raise TrackdiagError(f"{path}: a batch dict needs keys x/y or inputs/targets, got {sorted(obj)}")
        obj = pair
    if not isinstance(obj, (list, tuple)) or len(obj) < 2:
        raise TrackdiagError(f"{path}: expected (inputs, targets), got {type(obj).__name__}")
    return obj[0], obj[1]


def run(args: argparse.Namespace) -> int:
    from trackdiag.forensics.landscape import loss_landscape
    from trackdiag.plots.landscape import save_landscape

    try:
        model = load_model(args.checkpoint, args.factory, args.device)
        batch = load_batch(args.batch, args.device)
        result = loss_landscape(model, batch, args.loss, dims=args.dims, steps=args.steps, span=args.span,
                                max_evals=args.max_evals, seed=args.seed, progress=not args.no_progress)
    except (TrackdiagError, FileNotFoundError) as exc:
        print(f"trackdiag landscape: {exc}")
        return 2
    png, js = save_landscape(result, args.out, args.name)
    print(json.dumps({"png": str(png), "json": str(js), "center_loss": result.center_loss, "evals": result.evals,
                      "seconds": round(result.seconds, 3)}))
    return 0

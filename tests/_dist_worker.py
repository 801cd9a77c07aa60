"""One rank of a 2-process gloo run for tests/test_distributed.py: ``python _dist_worker.py SCENARIO OUT``.

Rank/world/port come from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Each rank
writes ``OUT/rank<N>.json`` with what it saw; the test compares them.
"""
from __future__ import annotations

import copy
import json
import math
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trackdiag
from _clip import clip_checked

GLOBAL_BATCH, STEPS = 32, 10
BASE = {"level": "basic", "every": 1, "probes": {"grads": {"per_layer": True}, "params": {"per_layer": True}}}


def model_and_data() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, 8, generator=gen), torch.randint(0, 4, (GLOBAL_BATCH,), generator=gen)) for _ in range(STEPS)]
    return model, data


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def ddp(out: Path, rank: int, world: int, nan: bool) -> dict:
    model, data = model_and_data()
    ref, ref_opt = copy.deepcopy(model), None
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    wrapped = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    cfg = dict(BASE, output_dir=str(out / "run"))
    sinks = ["local"]
    if nan:
        cfg["every"] = 4
        cfg["rules"] = {"nonfinite_loss": {"action": "stop"}}
    elif os.environ.get("TD_MLFLOW_URI"):
        sinks.append("mlflow")
        cfg["sink"] = {"mlflow": {"tracking_uri": os.environ["TD_MLFLOW_URI"], "experiment": "dist", "delivery": "thread"}}
    diag = trackdiag.Diagnostics(wrapped, opt, sinks=sinks, **cfg)
    ref_norms, ref_losses, stopped_at = [], [], None
    with diag:
        for step, (x, y) in enumerate(data):
            xr = shard(x, rank, world).clone()
            if nan and rank == 1 and step == 5:
                xr[0, 0] = float("nan")
            loss = F.cross_entropy(wrapped(xr), shard(y, rank, world))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if not nan:  # the single-process reference on the same global batch
                ref_loss = F.cross_entropy(ref(x), y)
                ref_loss.backward()
                ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf).item())
                ref_losses.append(ref_loss.item())
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
            if diag.step(loss):
                stopped_at = step
                break
    return {"ref_norms": ref_norms, "ref_losses": ref_losses, "stopped_at": stopped_at,
            "alerts": [a.to_dict() for a in diag.alerts]}


def fsdp(out: Path, rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, data = model_and_data()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diag = trackdiag.Diagnostics(model, opt, sinks=["local"], output_dir=str(out / "run"), **BASE)
    norms, layer0 = [], []
    with diag:
        for x, y in data:
            F.cross_entropy(model(shard(x, rank, world)), shard(y, rank, world)).backward()
            total = clip_checked(model.parameters(), math.inf)
            norms.append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
            full = [p.grad.full_tensor() for p in model[0].parameters()]
            layer0.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in full])).item())
            opt.step()
            opt.zero_grad(set_to_none=True)
            diag.step(None)
    return {"clip_norms": norms, "layer0": layer0, "alerts": [a.to_dict() for a in diag.alerts]}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = fsdp(out, rank, world) if scenario == "fsdp" else ddp(out, rank, world, nan=scenario == "nan")
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        # rank 0 hosts the TCP store: if it tears down and exits while rank 1 is still in
        # destroy_process_group, rank 1's gloo threads can abort the process ("terminate called
        # without an active exception", seen on a loaded 2-core CI machine). Leave together.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

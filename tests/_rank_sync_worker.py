"""One rank of a gloo run for tests/test_silent_ranks.py: ``python _rank_sync_worker.py SCENARIO OUT``.

Rank/world/port from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Scenarios (DDP unless
named fsdp_*): ``healthy`` (DistributedSampler), ``edit`` (the last rank scales layer 2's weight in place
after the optimizer step of step EDIT_AT), ``replaced`` (layer 2's weight replaced by a new Parameter after
wrapping), ``nosync`` (every backward under ``no_sync``: gradients never all-reduced), ``samedata`` (a
shuffled DataLoader without DistributedSampler, seeded alike on every rank), ``fsdp_healthy`` /
``fsdp_samedata`` (FSDP2 ``fully_shard``). Each rank writes ``OUT/rank<N>.json``: its alerts and, per
logging step, the rank_sync keys of its record.
"""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import trackdiag

STEPS, EVERY, EDIT_AT, BATCH = 14, 2, 5, 8
CFG = {"level": "basic", "every": EVERY, "budget": None,
       "probes": {"rank_sync": {"enabled": True, "every": EVERY}, "params": {"enabled": False}}}


def data() -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(512, 8, generator=gen), torch.randint(0, 4, (512,), generator=gen))


def loader(rank: int, world: int, sampler: bool) -> DataLoader:
    ds = data()
    if sampler:
        return DataLoader(ds, batch_size=BATCH, sampler=DistributedSampler(ds, num_replicas=world, rank=rank, seed=0))
    torch.manual_seed(0)  # the same seed on every rank: the same shuffled order everywhere
    return DataLoader(ds, batch_size=BATCH, shuffle=True)


def run(scenario: str, out: Path, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    if scenario.startswith("fsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    else:
        wrapped = nn.parallel.DistributedDataParallel(model, find_unused_parameters=scenario == "replaced")
        if scenario == "replaced":  # after wrapping: DDP's reducer never sees the new parameter
            model[2].weight = nn.Parameter(model[2].weight.detach().clone())
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    diag = trackdiag.Diagnostics(wrapped, opt, sinks=["local"], output_dir=str(out / "run"), **CFG)
    logged: dict[int, dict] = {}
    batches = iter(loader(rank, world, sampler=scenario not in ("samedata", "fsdp_samedata")))
    with diag:
        for step in range(STEPS):
            x, y = next(batches)
            if scenario == "nosync":
                with wrapped.no_sync():  # accumulation that never leaves the no_sync block
                    F.cross_entropy(wrapped(x), y).backward()
            else:
                F.cross_entropy(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if scenario == "edit" and step == EDIT_AT and rank == world - 1:
                with torch.no_grad():
                    model[2].weight.mul_(1.001)
            diag.step(None)
            rec = diag._history[-1] if diag._history else None  # this rank's view of the record
            if rec is not None and rec.step == step:
                logged[step] = {**{k: v for k, v in rec.scalars.items() if "/ranks/" in k},
                                **{k: v for k, v in rec.tables.items() if "/ranks/" in k}}
    return {"alerts": [a.to_dict() for a in diag.alerts], "logged": logged}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        result = run(scenario, out, rank, world)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()  # leave together (see _dist_worker.py)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Issue 45 items 5 and 6 on corpus models under DDP: ranks whose weights part, and ranks that read the same batches.

Eight models of the breadth corpus (``tests/_styles``: distillation's student MLP, amp_bf16's residual MLP,
mixup_ema's conv net with BatchNorm, moe_top1's mixture of experts, whose unrouted experts need
``find_unused_parameters``, accelerate_cv's GroupNorm conv net, finetune_frozen's BatchNorm conv net trained whole,
checkpointed_warmup's transformer with activation checkpointing, multitask's dict of heads) are trained on the digits, wrapped in ``DistributedDataParallel`` under gloo, 2 processes
on 127.0.0.1, the session built as the corpus builds it (``_harness.local_session``, preset ``advanced``). Scenarios:

- ``healthy``: a ``DistributedSampler`` per rank;
- ``part``: at step ``ONSET`` the last rank re-initialises one middle layer after its optimizer step (a checkpoint
  loaded on rank 0 only, a rank-conditional re-init): DDP all-reduces gradients, never weights, so the replicas part
  silently; expected ``ranks_diverged`` naming that layer within 50 steps;
- ``samedata``: a shuffled loader without ``DistributedSampler``, seeded alike on every rank (from step 0):
  expected ``ranks_same_data`` within 100 steps.

Prints a table model x scenario: the first warning-or-worse alert (``kind +named/+raised`` from the onset, ``where``)
and "caught" when it is the expected kind within the window. Cost: one 2-process launch per cell (~10 s on 2 cores).

Usage: python benchmarks/ddp_silent.py [--models a,b] [--scenarios healthy,part,samedata] [--steps 110] [--json out]
(a worker when RANK is set: ``python benchmarks/ddp_silent.py --worker MODEL SCENARIO OUT STEPS``)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

ONSET, WINDOW, START_WINDOW, BATCH = 40, 50, 100, 32
MODELS = ("distillation", "amp_bf16", "mixup_ema", "moe_top1", "accelerate_cv", "finetune_frozen", "checkpointed_warmup",
          "multitask")
SCENARIOS = ("healthy", "part", "samedata")
EXPECTED = {"part": "ranks_diverged", "samedata": "ranks_same_data"}
#: the middle layer the last rank re-initialises under ``part`` (as trackdiag names layers)
PARTED = {"distillation": "layers.3", "amp_bf16": "blocks.0.mlp.0", "mixup_ema": "features.3", "moe_top1": "router",
          "accelerate_cv": "features.3", "finetune_frozen": "backbone.3", "checkpointed_warmup": "blocks.1.mlp.0",
          "multitask": "trunk.3"}


def build(name: str) -> tuple[Any, Any]:
    """The corpus model ``name`` and a function from a digits batch to its input."""
    from _styles import load

    mod = load(name)
    if name == "distillation":
        return mod.Net(32, 0.1), lambda x: x
    if name == "amp_bf16":
        return mod.ResMLP(), lambda x: x
    if name == "mixup_ema":
        return mod.SmallConvNet(), lambda x: x.view(-1, 1, 8, 8)
    if name == "accelerate_cv":
        return mod.ConvNet(), lambda x: x.view(-1, 1, 8, 8)
    if name == "finetune_frozen":  # trained whole here: the style's frozen backbone is not what DDP is about
        return mod.Net(), lambda x: x.view(-1, 1, 8, 8)
    if name == "checkpointed_warmup":  # activation checkpointing under DDP (use_reentrant=False)
        return mod.Net(), lambda x: x
    if name == "multitask":  # a dict of heads; the digit head's logits are the loss here
        return mod.MultiTaskNet(), lambda x: x
    return mod.SwitchMoE(), lambda x: x


def worker(name: str, scenario: str, out: Path, steps: int) -> None:
    """One rank: train ``name`` under DDP for ``steps`` steps, write its alerts to ``out/rank<N>.json``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from _harness import local_session, one_thread
    from _styles._common import digits

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        xtr, ytr, _, _ = digits()
        torch.manual_seed(0)
        model, prep = build(name)
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=name in ("moe_top1", "multitask"))
        opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
        ds = TensorDataset(xtr, ytr)
        if scenario == "samedata":  # no DistributedSampler: the same seed, the same order, on every rank
            loader = DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True,
                                generator=torch.Generator().manual_seed(0))
        else:
            loader = DataLoader(ds, batch_size=BATCH, drop_last=True,
                                sampler=DistributedSampler(ds, num_replicas=world, rank=rank, seed=0))
        diag = local_session(ddp, opt, out / f"run{rank}", "advanced")
        step, epoch = 0, 0
        with one_thread(), diag:
            while step < steps:
                if hasattr(loader.sampler, "set_epoch"):
                    loader.sampler.set_epoch(epoch)
                for x, y in loader:
                    logits = ddp(prep(x))
                    logits = logits[0] if isinstance(logits, tuple) else logits["digit"] if isinstance(logits, dict) else logits
                    loss = F.cross_entropy(logits, y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    if scenario == "part" and step == ONSET and rank == world - 1:
                        model.get_submodule(PARTED[name]).reset_parameters()
                    diag.step(loss, outputs=logits, batch=(x, y))
                    step += 1
                    if step >= steps:
                        break
                epoch += 1
        (out / f"rank{rank}.json").write_text(json.dumps([a.to_dict() for a in diag.alerts]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(name: str, scenario: str, steps: int, world: int = 2, timeout: int = 300) -> list[list[dict[str, Any]]]:
    """Run every rank of one cell; returns each rank's alerts (dicts). Raises when a rank failed."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()), "WORLD_SIZE": str(world),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, scenario, tmp, str(steps)]
        procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(world)]
        logs = []
        try:
            logs = [p.communicate(timeout=timeout)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(p.returncode for p in procs):
            raise RuntimeError(f"{name}/{scenario}: a rank failed:\n" + "\n----\n".join(log[-3000:] for log in logs))
        return [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]


def judge(scenario: str, alerts: list[dict[str, Any]]) -> tuple[str, bool]:
    """The cell for one rank's alerts and whether it is caught (healthy: no warning-or-worse alert at all)."""
    loud = sorted((a for a in alerts if a["severity"] in ("warning", "critical")), key=lambda a: a["step"])
    if scenario == "healthy":
        return ("none" if not loud else ", ".join(f"{a['kind']}@{a['step']}" for a in loud)), not loud
    if not loud:
        return "missed", False
    onset = ONSET if scenario == "part" else 0
    first = loud[0]
    ok = first["kind"] == EXPECTED[scenario] and first["step"] - onset <= (WINDOW if scenario == "part" else START_WINDOW)
    return f"{first['kind']} +{first['step'] - onset} `{first['where']}`", ok


def main() -> int:
    if "--worker" in sys.argv:
        i = sys.argv.index("--worker")
        name, scenario, out, steps = sys.argv[i + 1:i + 5]
        worker(name, scenario, Path(out), int(steps))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=110, help="enough for rank_sync's logging steps 0, 50 and 100")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")
    rows: dict[str, dict[str, Any]] = {}
    print("| model | " + " | ".join(scenarios) + " |\n|---|" + "---|" * len(scenarios))
    for name in args.models.split(","):
        cells = []
        for sc in scenarios:
            ranks = launch(name, sc, args.steps)
            judged = [judge(sc, r) for r in ranks]
            same = len({json.dumps(r, sort_keys=True) for r in ranks}) == 1
            text, ok = judged[0]
            ok = ok and all(j[1] for j in judged)
            rows.setdefault(name, {})[sc] = {"ranks": ranks, "caught": ok, "same_on_every_rank": same}
            cells.append(text + (" **caught**" if ok and sc != "healthy" else "") + ("" if same else " (ranks differ)"))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

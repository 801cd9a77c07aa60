"""How far each preset sits from the floor, and what each part of it costs at the margin.

    python benchmarks/floor.py                                   # small MLP: floor, machinery, basic, advanced
    python benchmarks/floor.py --workload seq2seq --drop basic:data_finite basic:zerograd,modes,setup
    python benchmarks/floor.py --judge                           # a logging step's Python inline vs on a thread

Arms, interleaved step by step in one process (each its own model, optimizer and batch stream from one seed; the
cost budget off, so every arm keeps its cadence):

- ``bare``: the loop alone;
- ``floor``: the device work the every-step series need, written by hand with nothing around it: one gradient
  hook that queues one end-of-backward callback, one ``_foreach_norm`` over the gradients there, the loss detached
  into a list (cleared every 50 steps). No implementation of ``basic`` can cost less than this;
- ``fused``: ``basic``'s every-step work (the floor's, plus the zero-grad sentinel's reset test, the optimizer's
  same-gradients check, the input's ``aminmax``, the pass and step counts) as one fused program would do it: one
  Python call per hook, nothing dispatched per probe, one tuple a step into a ring. What a new step path could cost;
- ``machinery``: a ``basic`` session with every probe off but ``loss`` and a logging step every 1,000 steps: the
  session's own per-step path (gradient tap, optimizer hooks, ``step()``) over the floor;
- each preset in ``--presets``, and each ``--drop PRESET:PROBE[,PROBE...]``: that preset with those probes off
  (the marginal cost of those probes is the preset's row less this one).

Printed per arm: the median over rounds of the wall time per step and of its excess over the bare loop's in the
same round (us), and the median ratio. ``--judge`` instead times the Python a logging step runs (a busy loop of
``--judge-us`` microseconds every 10 steps) inline, on a background thread, and on a thread in 50 us pieces, each
arm in blocks of ``--steps`` steps timed until its thread's queue is empty (interleaved step by step, a thread's work
would land in the other arms' steps): whether judging a record off the training thread would take its cost off a
CPU-bound loop (the GIL says no).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import threading
import queue
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's trackdiag
import workloads  # noqa: E402
from trackdiag import Diagnostics  # noqa: E402
from trackdiag.core.presets import load_preset  # noqa: E402


class Arm:
    """One contender: its own model, optimizer, batches; ``extra`` runs after each step (the floor's own work)."""

    def __init__(self, name: str, wl: workloads.Workload, overrides: dict[str, Any] | None, level: str = "basic") -> None:
        torch.manual_seed(0)
        self.name, self.wl = name, wl
        self.model = wl.make_model()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=wl.lr)
        self.gen = torch.Generator().manual_seed(1)
        self.diag = None
        self.extra: Callable[[torch.Tensor], None] | None = None
        self.excess: list[float] = []
        self.walls: list[float] = []
        if overrides is not None:
            out = tempfile.mkdtemp(prefix=f"{level}-", dir=".")  # a run directory each; no console summary
            self.diag = Diagnostics(self.model, self.opt, level=level, sinks=["local"], budget=None, output_dir=out,
                                    sink={"console": {"enabled": False}}, **overrides)
            self.diag.__enter__()

    def step(self) -> float:
        x, y = self.wl.make_batch(self.gen)
        t0 = time.perf_counter()
        out = self.model(x)
        loss = self.wl.loss(out, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.wl.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.wl.clip)
        self.opt.step()
        if self.diag is not None:
            self.diag.step(loss, outputs=out, batch=(x, y))
        if self.extra is not None:
            self.extra(loss)
        return time.perf_counter() - t0


def floor_arm(wl: workloads.Workload) -> Arm:
    """The every-step device work alone (see the module docstring)."""
    arm = Arm("floor", wl, None)
    params = [p for p in arm.model.parameters() if p.requires_grad]
    norms: list[Any] = []
    losses: list[torch.Tensor] = []
    engine = torch.autograd.Variable._execution_engine

    def end() -> None:
        norms.append(torch._foreach_norm([p.grad for p in params]))

    params[-1].register_hook(lambda g: engine.queue_callback(end))

    def extra(loss: torch.Tensor) -> None:
        losses.append(loss.detach())
        if len(losses) >= 50:
            losses.clear()
            norms.clear()

    arm.extra = extra
    return arm


def fused_arm(wl: workloads.Workload) -> Arm:
    """``basic``'s every-step work as one fused program would do it, written by hand (module docstring): what a step
    path with one Python event per hook and no per-probe dispatch would cost, the device work included."""
    arm = Arm("fused", wl, None)
    params = [p for p in arm.model.parameters() if p.requires_grad]
    sentinel = min(params[-2:], key=lambda p: p.numel())
    engine = torch.autograd.Variable._execution_engine
    ring: list[Any] = []  # (step, loss, grad norms, sentinel reset, input aminmax, passes, stepped, repeat)
    state = {"queued": False, "passes": 0, "reset": None, "norms": None, "stepped": False, "repeat": False,
             "last": None, "step": 0}

    def end() -> None:
        state["queued"] = False
        state["norms"] = torch._foreach_norm([p.grad for p in params])

    def watch(_g: torch.Tensor) -> None:  # the zero-grad sentinel: reset before this pass accumulated?
        g = sentinel.grad
        state["reset"] = True if g is None else torch.linalg.vector_norm(g) == 0
        state["passes"] += 1
        if not state["queued"]:
            state["queued"] = True
            engine.queue_callback(end)

    sentinel.register_hook(watch)

    def pre(opt: Any, _args: Any, _kwargs: Any) -> None:  # stepped, and on the same gradients as the step before?
        g = sentinel.grad
        held = (g, g._version) if g is not None else None
        state["repeat"] = held is not None and state["last"] is not None and state["last"][0] is g \
            and state["last"][1] == held[1] and state["passes"] == 0
        state["last"], state["stepped"] = held, True

    arm.opt.register_step_pre_hook(pre)
    batch_of: list[torch.Tensor] = []

    def extra(loss: torch.Tensor) -> None:
        x = batch_of[-1] if batch_of else None
        ring.append((state["step"], loss.detach(), state["norms"], state["reset"],
                     torch.aminmax(x) if x is not None else None, state["passes"], state["stepped"], state["repeat"]))
        state["passes"], state["stepped"] = 0, False
        state["step"] += 1
        if len(ring) >= 50:
            ring.clear()

    arm.extra = extra
    arm.ring = ring  # type: ignore[attr-defined]  # read by tests/test_benchmarks.py
    make = wl.make_batch

    def make_batch(gen: torch.Generator) -> Any:
        x, y = make(gen)
        batch_of[:] = [x]
        return x, y

    arm.wl = dataclasses.replace(wl, make_batch=make_batch)
    return arm


def probes_off(level: str, keep: set[str] | None = None, drop: set[str] | None = None) -> dict[str, Any]:
    """Probe overrides: every probe of ``level`` off but ``keep``, or ``drop`` off."""
    names = list(load_preset(level)["probes"])
    unknown = (keep or set()) | (drop or set())
    if unknown - set(names):
        raise SystemExit(f"no probe {sorted(unknown - set(names))} in {level!r}: {', '.join(names)}")
    off = [n for n in names if (keep is not None and n not in keep) or (drop is not None and n in drop)]
    return {n: {"enabled": False} for n in off}


def run(arms: list[Arm], rounds: int, steps: int, warmup: int) -> None:
    for _ in range(warmup):
        for a in arms:
            a.step()
    for _ in range(rounds):
        spent = dict.fromkeys((a.name for a in arms), 0.0)
        for _ in range(steps):
            order = arms[:]
            random.shuffle(order)
            for a in order:
                spent[a.name] += a.step()
        bare = spent["bare"] / steps
        for a in arms:
            a.walls.append(spent[a.name] / steps)
            a.excess.append(spent[a.name] / steps - bare)
    for a in arms:
        if a.diag is not None:
            a.diag.close()


def judge_experiment(wl: workloads.Workload, judge_us: int, rounds: int, steps: int, warmup: int) -> None:
    """``--judge``: a logging step's Python inline, on a thread, on a thread in pieces (module docstring)."""
    def busy(us: float) -> None:
        end, d, i = time.perf_counter() + us * 1e-6, {}, 0
        while time.perf_counter() < end:
            d[i % 100] = sum(range(20))
            i += 1

    def pieces(us: int) -> None:
        for _ in range(max(us // 50, 1)):
            busy(50)
            time.sleep(0)  # lets the training thread take the GIL back between pieces

    jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()

    def worker() -> None:
        for job in iter(jobs.get, None):
            job()
            jobs.task_done()

    threading.Thread(target=worker, daemon=True).start()
    arms = [Arm(n, wl, None) for n in ("bare", "inline", "thread", "pieces")]
    count = {a.name: 0 for a in arms}

    def after(name: str) -> Callable[[torch.Tensor], None]:
        def extra(_loss: torch.Tensor) -> None:
            count[name] += 1
            if count[name] % 10:
                return
            if name == "inline":
                busy(judge_us)
            else:
                jobs.put(lambda: busy(judge_us) if name == "thread" else pieces(judge_us))
        return extra

    for a in arms[1:]:
        a.extra = after(a.name)
    for _ in range(warmup):
        for a in arms:
            a.step()
    jobs.join()
    # blocks, not steps, interleaved: a thread's work would otherwise land in the other arms' steps; each block's
    # time runs until its thread's queue is empty
    for _ in range(rounds):
        spent = {}
        for a in random.sample(arms, len(arms)):
            t0 = time.perf_counter()
            for _ in range(steps):
                a.step()
            jobs.join()
            spent[a.name] = (time.perf_counter() - t0) / steps
        for a in arms:
            a.walls.append(spent[a.name])
            a.excess.append(spent[a.name] - spent["bare"])
    jobs.put(None)
    report(arms, f"{wl.name}: {judge_us} us of Python every 10 steps, inline or off the training thread")


def report(arms: list[Arm], title: str) -> None:
    bare = arms[0]
    print(f"# {title} (torch {torch.__version__}, {torch.get_num_threads()} thread(s))")
    print("| arm | us/step | over bare, us | ratio |\n|---|---:|---:|---:|")
    for a in arms:
        ratio = statistics.median(w / b for w, b in zip(a.walls, bare.walls))
        print(f"| {a.name} | {1e6 * statistics.median(a.walls):.1f} | {1e6 * statistics.median(a.excess):+.1f} | {ratio:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="small")
    ap.add_argument("--presets", nargs="*", default=["basic", "advanced"])
    ap.add_argument("--drop", nargs="*", default=[], help="PRESET:PROBE[,PROBE...]: that preset with those probes off")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the per-step Python shows)")
    ap.add_argument("--judge", action="store_true", help="the off-thread judging experiment instead")
    ap.add_argument("--judge-us", type=int, default=700, help="--judge: microseconds of Python per logging step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.chdir(tempfile.mkdtemp(prefix="trackdiag-floor-"))
    wl = workloads.get(args.workload)
    if args.judge:
        judge_experiment(wl, args.judge_us, args.rounds, args.steps, args.warmup)
        return
    arms = [Arm("bare", wl, None), floor_arm(wl), fused_arm(wl),
            Arm("machinery", wl, {"every": 1000, "probes": probes_off("basic", keep={"loss"})})]
    arms += [Arm(p, wl, {}, level=p) for p in args.presets]
    for spec in args.drop:
        level, _, names = spec.partition(":")
        arms.append(Arm(f"{level} without {names}", wl, {"probes": probes_off(level, drop=set(names.split(",")))}, level))
    run(arms, args.rounds, args.steps, args.warmup)
    report(arms, f"{wl.name}: the floor, the session's machinery and the presets, interleaved step by step")


if __name__ == "__main__":
    main()

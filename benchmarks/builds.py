"""Two builds of trackdiag side by side in one process: which one costs less on a plain step.

    python benchmarks/builds.py OTHER_CHECKOUT [--presets basic advanced] [--rounds 12] [--workload small]

Separate processes cannot tell a change of ~20 us a step apart on a machine whose speed drifts between runs (this
2-core VM: the same build 61-142 us over the bare loop in six runs). Here the other checkout's ``trackdiag`` is copied
under another package name (``trackdiag_other``: its imports and its logger renamed) into a temporary directory, and
three arms (the bare loop, this checkout's build, the other build; each its own model, optimizer and batch stream
from one seed; the cost budget off) step in random order, one step each, after ``--warmup`` steps. Per round of
``--steps`` steps: the median thread time (``time.thread_time_ns``) of each arm's plain steps (a session's step that
its step plan knew to be no logging step), less the bare loop's. Prints, per preset, each build's median excess over
the rounds and in how many rounds this build was the cheaper one, with the difference (the mean of the two halves'
median differences; each half's on stderr). Both builds are
imported under names of their own (this checkout's as ``trackdiag_this``), and half the rounds make the other build's
session first: with this checkout imported as ``trackdiag`` and made first, a checkout run against itself read
"this build" 7-14 us dearer (``--presets basic advanced``, 6-8 rounds), in either direction.
"""
from __future__ import annotations

import argparse
import importlib
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]  # this checkout's trackdiag

import torch  # noqa: E402

import floor  # noqa: E402
import workloads  # noqa: E402

#: each build is imported under a name of its own, this checkout's too: an A/A run (a checkout against itself) with
#: this checkout imported as ``trackdiag`` and the other renamed read "this build" 7-14 us a plain step dearer on the
#: 2-core VM (2026-12-03), in both directions, so neither build is the plain ``trackdiag`` now
THIS, OTHER = "trackdiag_this", "trackdiag_other"


def _imports(name: str) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile(r"\btrackdiag\."), f"{name}."), (re.compile(r"\bfrom trackdiag import\b"), f"from {name} import"),
            (re.compile(r"^import trackdiag$", re.M), f"import {name}"), (re.compile(r'"trackdiag"\)'), f'"{name}")')]


def load_build(checkout: Path, into: Path, name: str = OTHER) -> Any:
    """The ``trackdiag`` package of ``checkout``, copied into ``into`` as ``name`` and imported."""
    dest = into / name
    shutil.copytree(checkout / "trackdiag", dest, ignore=shutil.ignore_patterns("__pycache__"))
    for path in dest.rglob("*.py"):
        text = path.read_text()
        for pattern, repl in _imports(name):
            text = pattern.sub(repl, text)
        path.write_text(text)
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


class Arm(floor.Arm):
    """floor.py's contender (its own model, optimizer and batch stream from one seed) with a session of ``module``'s
    ``Diagnostics`` (none: the bare loop); :meth:`timed` is one step's thread time and whether it was a plain step."""

    def __init__(self, name: str, wl: workloads.Workload, module: Any, level: str) -> None:
        super().__init__(name, wl, None)
        if module is not None:
            self.diag = module.Diagnostics(self.model, self.opt, level=level, sinks=["local"], budget=None,
                                           output_dir=tempfile.mkdtemp(prefix=f"{name}-", dir="."),
                                           sink={"console": {"enabled": False}})
            self.diag.__enter__()

    def timed(self) -> tuple[bool, int]:
        d = self.diag
        plain = d is None or d._next_check > d._ctx.step > d._ctx.anomaly_until
        t0 = time.thread_time_ns()
        self.step()
        return plain, time.thread_time_ns() - t0


def compare(builds: dict[str, Any], wl: workloads.Workload, level: str, rounds: int, steps: int,
            warmup: int) -> dict[str, Any]:
    """Per round, each build's median plain-step thread time over the bare loop's (us). Half the rounds with this
    build's session made first, half with the other's (each half its own arms and warm-up): whichever session is made
    first registers torch's global optimizer hooks first, and every optimizer's step runs both builds' hooks."""
    excess: dict[str, list[float]] = {"this": [], "other": []}
    for half, names in enumerate((("this", "other"), ("other", "this"))):
        arms = [Arm("bare", wl, None, level), *(Arm(n, wl, builds[n], level) for n in names)]
        for _ in range(warmup):
            for a in arms:
                a.timed()
        for _ in range(rounds // 2 + (rounds % 2 if half == 0 else 0)):
            times: dict[str, list[int]] = {a.name: [] for a in arms}
            for _ in range(steps):
                order = arms[:]
                random.shuffle(order)
                for a in order:
                    plain, ns = a.timed()
                    if plain:
                        times[a.name].append(ns)
            bare = statistics.median(times["bare"])
            for name in excess:
                excess[name].append((statistics.median(times[name]) - bare) / 1e3)
        for a in arms[1:]:
            a.diag.close()
    diff = [t - o for t, o in zip(excess["this"], excess["other"])]
    first = rounds // 2 + rounds % 2  # the rounds of the half that made this build's session first
    halves = [statistics.median(diff[:first]), statistics.median(diff[first:])] if rounds > 1 else diff
    return {"this": excess["this"], "other": excess["other"], "cheaper": sum(d < 0 for d in diff),
            "diff": statistics.mean(halves), "halves": halves}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout (its trackdiag/ is copied, not installed)")
    ap.add_argument("--presets", nargs="*", default=["basic", "advanced"])
    ap.add_argument("--workload", default="small")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=1500)
    args = ap.parse_args()
    if args.workload.endswith("+clip"):  # each build answers clip_grad_norm_ with its own tap (capture.clip_serve)
        raise SystemExit("builds.py: no +clip workload (both builds would wrap clip_grad_norm_)")
    torch.set_num_threads(1)
    os.chdir(tempfile.mkdtemp(prefix="trackdiag-builds-"))
    into = Path(tempfile.mkdtemp(prefix="trackdiag-builds-"))
    builds = {"this": load_build(ROOT, into, THIS), "other": load_build(args.other.resolve(), into, OTHER)}
    wl = workloads.get(args.workload)
    print(f"| {wl.name} | this build, plain step over bare (us) | other build | rounds this build cheaper | median "
          f"difference (us) |\n|---|---:|---:|---:|---:|")
    for level in args.presets:
        got = compare(builds, wl, level, args.rounds, args.steps, args.warmup)
        print(f"| {level} | {statistics.median(got['this']):.1f} | {statistics.median(got['other']):.1f} | "
              f"{got['cheaper']}/{args.rounds} | {got['diff']:+.1f} |", flush=True)
        print(f"  {level}: median difference with this build's session made first / second: "
              + " / ".join(f"{h:+.1f}" for h in got["halves"]), file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()

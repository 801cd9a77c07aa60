"""Where the suite's CPU goes: sums ``TRACKDIAG_TEST_CPU`` lines (tests/conftest.py) by test module.

Usage: TRACKDIAG_TEST_CPU=/tmp/cpu.tsv .venv/bin/python -m pytest -q; python scripts/test_cpu_report.py /tmp/cpu.tsv [N]
Prints the total CPU and wall seconds, then the N (20) costliest modules and tests by CPU, then (lines that carry a
start time and a worker) each worker's busy span and the tests that ran in each minute of the suite: what was running
together when the cores idled.
"""
from __future__ import annotations

import sys
from collections import defaultdict


def main(path: str, top: int = 20) -> None:
    rows = [line.rstrip("\n").split("\t") for line in open(path) if line.count("\t") in (2, 4)]
    tests = [(r[0], float(r[1]), float(r[2])) for r in rows]
    mods: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for node, cpu, wall in tests:
        m = mods[node.split("::")[0]]
        m[0] += cpu
        m[1] += wall
        m[2] += 1
    print(f"{len(tests)} tests: {sum(c for _, c, _ in tests):.0f} CPU-s, {sum(w for *_, w in tests):.0f} test-wall-s")
    print(f"\n{'CPU-s':>8} {'wall-s':>8} {'tests':>5}  module")
    for mod, (cpu, wall, n) in sorted(mods.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{cpu:8.0f} {wall:8.0f} {n:5d}  {mod}")
    print(f"\n{'CPU-s':>8} {'wall-s':>8}  test")
    for node, cpu, wall in sorted(tests, key=lambda t: -t[1])[:top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {node}")
    timed = [(float(r[3]), float(r[2]), float(r[1]), r[4], r[0]) for r in rows if len(r) == 5]
    if timed:
        timeline(timed)


def timeline(timed: list[tuple[float, float, float, str, str]]) -> None:
    """Per minute of the suite: CPU-s the tests spent and the longest tests running then, per worker."""
    t0 = min(t for t, *_ in timed)
    end = max(t + w for t, w, *_ in timed)
    workers = sorted({w for *_, w, _ in timed})
    print(f"\nworkers: {len(workers)}; first test to last: {end - t0:.0f} s")
    for w in workers:
        mine = [(t, wall) for t, wall, _, ww, _ in timed if ww == w]
        print(f"  {w}: busy {sum(x for _, x in mine):.0f} s, last test ends at {max(t + x for t, x in mine) - t0:.0f} s")
    print(f"\n{'minute':>6} {'CPU-s':>6}  longest test of each worker then (wall s)")
    for m in range(int((end - t0) // 60) + 1):
        lo, hi = t0 + 60 * m, t0 + 60 * (m + 1)
        cpu = 0.0
        longest: dict[str, tuple[float, str]] = {}
        for t, wall, c, w, node in timed:
            overlap = min(hi, t + wall) - max(lo, t)
            if overlap > 0:
                cpu += c * overlap / wall if wall else c
                if overlap > longest.get(w, (0.0, ""))[0]:
                    longest[w] = (overlap, node)
        names = "; ".join(f"{w}:{node.split('::')[-1][:40]}({o:.0f})" for w, (o, node) in sorted(longest.items()))
        print(f"{m:6d} {cpu:6.0f}  {names}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)

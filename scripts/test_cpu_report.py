"""Where the suite's CPU goes: sums ``TRACKDIAG_TEST_CPU`` lines (tests/conftest.py) by test module.

Usage: TRACKDIAG_TEST_CPU=/tmp/cpu.tsv .venv/bin/python -m pytest -q; python scripts/test_cpu_report.py /tmp/cpu.tsv [N]
Prints the total CPU and wall seconds, then the N (20) costliest modules and tests by CPU.
"""
from __future__ import annotations

import sys
from collections import defaultdict


def main(path: str, top: int = 20) -> None:
    rows = [line.rstrip("\n").split("\t") for line in open(path) if line.count("\t") == 2]
    tests = [(node, float(cpu), float(wall)) for node, cpu, wall in rows]
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


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)

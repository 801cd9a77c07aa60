"""Every process of a suite run and its CPU, from BSD process accounting (``ACCT=1 bash scripts/suite_cpu.sh``).

The census (:mod:`census_site`) writes a line when a Python process exits on its own; a process killed by a signal
(a server stopped with its group, a job a test kills, a worker orphaned by its parent) or one that is not Python
(PostgreSQL, Chromium, Ray's raylet) writes none. The kernel writes a record for every process that ends, whatever
ended it (``acct(2)``, ``struct acct_v3``): its command name, parent, CPU, lifetime and exit. With the census's lines
(``argv`` at start and at exit, by pid) the report names each Python process by what it ran.

Usage: python scripts/acct_report.py OUT_DIR [N]  (reads OUT_DIR/pacct, census.tsv and starts.tsv when present)
Prints the total, the CPU by kind of process, the processes that outlived their parent (orphans, by CPU), and the
subprocesses' CPU by the test that started them.
"""
from __future__ import annotations

import struct
import sys
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

RECORD = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")  # struct acct_v3 (linux/acct.h): 64 bytes
AHZ = 100  # the record's clock ticks per second (AHZ)


class Proc(NamedTuple):
    pid: int
    ppid: int
    comm: str
    cpu: float  # user + system seconds
    wall: float  # seconds from start to exit
    exit: int  # the wait status: 9 = killed by SIGKILL


def comp_t(value: int) -> int:
    """A ``comp_t``: 13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 7))


def read_pacct(path: Path) -> list[Proc]:
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, off)
        if f[1] != 3:  # ac_version
            continue
        out.append(Proc(pid=f[6], ppid=f[7], comm=f[18].split(b"\0")[0].decode(errors="replace"),
                        cpu=(comp_t(f[10]) + comp_t(f[11])) / AHZ, wall=f[9] / AHZ, exit=f[3]))
    return out


def read_names(out: Path) -> dict[int, tuple[str, str]]:
    """pid -> (test, argv) from the census: start lines (``starts.tsv``) and exit lines (``census.tsv``)."""
    names: dict[int, tuple[str, str]] = {}
    if (out / "starts.tsv").exists():
        for line in open(out / "starts.tsv"):
            pid, _ppid, test, argv = (line.rstrip("\n").split("\t", 3) + ["", ""])[:4]
            names[int(pid)] = (test, argv)
    if (out / "census.tsv").exists():
        for line in open(out / "census.tsv"):
            parts = line.rstrip("\n").split("\t")
            if len(parts) >= 6 and parts[4].isdigit():
                names.setdefault(int(parts[4]), (parts[0], parts[5]))  # an exit line knows a forked child's argv
    return names


def kind(proc: Proc, names: dict[int, tuple[str, str]]) -> str:
    """A short name for what ``proc`` ran: the script or module of a Python process the census saw, else its command."""
    if proc.pid not in names:
        return proc.comm
    words = names[proc.pid][1].split()
    while words and words[0] in ("-u", "-B", "-E", "-I", "-s", "-S"):  # interpreter options (xdist's workers: -u -c)
        words = words[1:]
    if not words:
        return "python"
    for mark in ("mlflow.worker", "mlflow.leftovers", "mlflow server", "mlflow ui", "uvicorn", "--multiprocessing-fork"):
        if mark in names[proc.pid][1]:
            return f"python {mark}"
    if words[0] in ("-c", "-m"):  # the code's first word, or the module
        return f"python {' '.join(words[:2])}"[:60]
    return f"python {Path(words[0]).name}"


def main(out: Path, top: int = 25) -> None:
    procs = read_pacct(out / "pacct")
    names = read_names(out)
    print(f"{len(procs)} processes ended: {sum(p.cpu for p in procs):.0f} CPU-s")
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for p in procs:
        k = kinds[kind(p, names)]
        k[0] += 1
        k[1] += p.cpu
    print(f"\n{'CPU-s':>8} {'procs':>6}  kind")
    for name, (n, cpu) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{cpu:8.1f} {int(n):6d}  {name}")
    orphans = sorted((p for p in procs if p.ppid == 1), key=lambda p: -p.cpu)
    print(f"\norphans (their parent ended first): {len(orphans)}, {sum(p.cpu for p in orphans):.0f} CPU-s")
    for p in orphans[:top]:
        test, _ = names.get(p.pid, ("", ""))
        print(f"{p.cpu:8.1f} {p.wall:7.0f}s exit={p.exit:<4} {kind(p, names)}  {test}")
    by_test: dict[str, float] = defaultdict(float)
    for p in procs:
        test = names.get(p.pid, ("-", ""))[0]
        if test not in ("-", ""):
            by_test[test] += p.cpu
    print(f"\n{'CPU-s':>8}  subprocesses of the test")
    for test, cpu in sorted(by_test.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8.1f}  {test}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:3]))

"""The real-code fault zoo as a table: for each script and planted fault, the first alert of
warning or worse (kind, step, steps after the fault's onset, where) and, for healthy runs, every
alert. The README's detection table is this script's output.

Usage: python benchmarks/fault_zoo.py [--scripts wordlm,chargpt,cnn,names] [--faults ...]
       [--level advanced] [--json out.json] [--markdown]
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's trackdiag, and the zoo

from _zoo_real import FAULTS, NOT_APPLICABLE, SCRIPTS  # noqa: E402
from test_fault_zoo import AS_INFO  # noqa: E402


def run_one(script: str, fault: str | None, level: str) -> dict:
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r = SCRIPTS[script](fault, Path(tmp), level=level) if fault is None else \
            SCRIPTS[script](fault, Path(tmp), level=level, steps=None or _steps(script, fault))
        # a layer frozen and handed to the optimizer is how fine-tuning freezes a backbone: found as info
        first = r.first(min_severity="info" if fault in AS_INFO else "warning")
        raised = None if first is None else r.raised_at(first)  # read from the record, before it is deleted
    alerts = [(a.kind, a.step, a.severity, a.where) for a in r.diag.alerts]
    return {"script": script, "fault": fault or "healthy", "onset": r.onset, "culprit": r.culprit,
            "first": None if first is None else {"kind": first.kind, "step": first.step, "where": first.where,
                                                  "severity": first.severity,
                                                  "after": first.step - r.onset, "raised_after": raised - r.onset},
            "alerts": alerts, "seconds": round(time.perf_counter() - t0, 1)}


def _steps(script: str, fault: str) -> int:
    if fault == "tiny_subset":
        return 300
    if fault == "leak":
        return 200
    return 100


def _worker(job: tuple[str, str, str]) -> dict:
    """One case in a fresh process: a leak must be seen in the process's own RSS, not hidden by
    memory an earlier case freed."""
    logging.getLogger("trackdiag").setLevel(logging.ERROR)
    script, fault, level = job
    return run_one(script, None if fault == "healthy" else fault, level)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--faults", default="healthy," + ",".join(FAULTS))
    ap.add_argument("--level", default="advanced")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once, each in its own process")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", action="store_true", help="print the README table")
    args = ap.parse_args()
    cases = [(s, f, args.level) for s in args.scripts.split(",") for f in args.faults.split(",")]
    todo = [c for c in cases if c[:2] not in NOT_APPLICABLE]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
        done = dict(zip(todo, pool.map(_worker, todo, chunksize=1)))
    rows = []
    for script, fault, _ in cases:
        if (script, fault) in NOT_APPLICABLE:
            rows.append({"script": script, "fault": fault, "na": NOT_APPLICABLE[(script, fault)]})
            print(f"{script:8} {fault:16} n/a: {NOT_APPLICABLE[(script, fault)]}", flush=True)
            continue
        else:
            row = done[(script, fault, args.level)]
            rows.append(row)
            f = row["first"]
            if fault == "healthy":
                bad = [a for a in row["alerts"] if a[2] != "info"]
                print(f"{script:8} {fault:16} {'OK' if not bad else 'FALSE ALARMS ' + str(bad)}  "
                      f"(info: {[a for a in row['alerts'] if a[2] == 'info']}) {row['seconds']}s", flush=True)
            else:
                desc = "MISSED" if f is None else (f"{f['kind']} @ {f['step']} (+{f['after']}, raised +{f['raised_after']})"
                                                   f" where={f['where']!r}")
                print(f"{script:8} {fault:16} {desc}   all={sorted({a[0] for a in row['alerts']})} {row['seconds']}s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(markdown(rows, args.scripts.split(","), [f for f in args.faults.split(",")]))
    return 0


def markdown(rows: list[dict], scripts: list[str], faults: list[str]) -> str:
    """Faults down, scripts across; a cell is the first alert's kind, +steps from the onset to the step it
    names / to the logging step that raised it."""
    by = {(r["script"], r["fault"]): r for r in rows}
    out = ["| fault | " + " | ".join(scripts) + " |", "|---|" + "---|" * len(scripts)]
    for fault in faults:
        cells = []
        for script in scripts:
            r = by[(script, fault)]
            if "na" in r:
                cells.append("n/a")
            elif fault == "healthy":
                bad = [a for a in r["alerts"] if a[2] != "info"]
                cells.append("no alert" if not bad else "**" + ", ".join(sorted({a[0] for a in bad})) + "**")
            elif r["first"] is None:
                cells.append("**missed**")
            else:
                f = r["first"]
                if fault == "tiny_subset":  # present from the start: the step it names is the overfitting onset
                    cells.append(f"`{f['kind']}` onset {f['step']}, raised {f['raised_after'] + r['onset']}")
                else:
                    info = " (info)" if f.get("severity") == "info" else ""
                    cells.append(f"`{f['kind']}`{info} +{f['after']} / +{f['raised_after']}")
        out.append(f"| {fault} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

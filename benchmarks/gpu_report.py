"""Writes scripts/gpu_check.sh's markdown report from what its stages left in the output dir:
``env.txt``, ``stages.tsv`` (stage, exit code, seconds, budget), ``pytest_cuda.xml`` (JUnit),
``bench_eager.json`` / ``bench_compiled.json`` (benchmarks/overhead.py --json) and ``gpu_check.log``.

    python benchmarks/gpu_report.py OUTDIR      # prints the verdict; exit 0 only if everything passed

The verdict fails when: CUDA was absent (a dry run on CPU included), a stage failed or ran out of
time, no CUDA test ran, a CUDA test failed *or skipped* (on a GPU machine a skip means a CUDA path
went unchecked), or a benchmark left a workload without its bare row.
"""
from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from table import markdown  # noqa: E402


def _uncollected_without_cuda(case: ET.Element) -> bool:
    """A test module skipped at collection (``importorskip`` of a package this box lacks) whose source
    names neither CUDA nor a GPU: no CUDA test of the suite was left unchecked by it."""
    skipped = case.find("skipped")
    if skipped is None or skipped.get("message") != "collection skipped" or not case.get("file"):
        return False
    source = ROOT / case.get("file", "")
    return source.is_file() and not re.search(r"\b(cuda|gpu)\b", source.read_text(), re.IGNORECASE)


def _tests(xml: Path) -> tuple[list[tuple[str, str, float, str]], list[str]]:
    """(name, outcome, seconds, message) per test case, and problems."""
    if not xml.exists():
        return [], ["no JUnit file: the test stage did not run or was killed before pytest wrote it"]
    cases, problems = [], []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if _uncollected_without_cuda(case):  # a module needing what this box lacks (mlflow, wandb), no CUDA test in it
            continue
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, msg = {"failure": "FAILED", "error": "ERROR", "skipped": "SKIPPED"}[tag], (el.get("message") or "")[:300]
                break
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        cases.append((name, outcome, float(case.get("time") or 0), msg))
    problems += [f"{n}: {o} {m}" for n, o, _, m in cases if o != "passed"]
    if not cases:
        problems.append("no CUDA test was collected")
    return cases, problems


def _bench(path: Path, title: str) -> tuple[list[str], list[str]]:
    if not path.exists():
        return [f"### {title}", "", "_no result file: the stage did not run or was killed before its first workload finished_"], [f"{title}: no results"]
    data = json.loads(path.read_text())
    rows = data["rows"]
    compiled = bool(data.get("settings", {}).get("compile"))
    problems = [f"{title}: {r['workload']} bare failed: {r['error']}" for r in rows if r["arm"] == "bare" and r.get("error")]
    if not data.get("complete"):
        problems.append(f"{title}: incomplete (timed out after {len({r['workload'] for r in rows})} workloads)")
    s = data.get("settings", {})
    out = [f"### {title}", "", f"{data['environment']} | rounds {s.get('rounds')} x {s.get('steps')} steps, block {s.get('block')}, "
           f"warmup {s.get('warmup')}{'' if data.get('complete') else ' | **incomplete: stage ran out of time**'}", "", markdown(rows, compiled)]
    if data.get("skipped"):
        out += ["", "Skipped arms: " + "; ".join(data["skipped"])]
    notes = [f"- {r['workload']} / {r['arm']}: {n.strip().splitlines()[-1][:300]}" for r in rows for n in r.get("notes", []) if n.strip()]
    if notes:
        out += ["", "Notes:", *notes]
    return out, problems


def main(outdir: Path) -> int:
    env = (outdir / "env.txt").read_text() if (outdir / "env.txt").exists() else "(no env.txt)"
    stages = [line.split("\t") for line in (outdir / "stages.tsv").read_text().splitlines() if line.strip()] \
        if (outdir / "stages.tsv").exists() else []
    problems: list[str] = []
    if "CUDA: yes" not in env:
        problems.append("CUDA was not available: these are NOT GPU results")
    table = ["| stage | exit | seconds | budget |", "|---|---:|---:|---:|"]
    for name, rc, secs, budget in stages:
        table.append(f"| {name} | {rc} | {secs} | {budget} |")
        if rc in ("124", "137"):
            problems.append(f"stage {name} ran out of its {budget} s budget")
        elif rc != "0":
            problems.append(f"stage {name} exited {rc}")
    cases, tp = _tests(outdir / "pytest_cuda.xml")
    problems += tp
    eager, ep = _bench(outdir / "bench_eager.json", "GPU benchmark, eager")
    comp, cp = _bench(outdir / "bench_compiled.json", "GPU benchmark, torch.compile")
    problems += ep + cp
    verdict = "PASSED" if not problems else "FAILED"
    lines = [f"# trackdiag GPU check: {verdict}", ""]
    if problems:
        lines += ["Problems:", *[f"- {p}" for p in problems], ""]
    lines += ["## Environment", "", "```", env.strip(), "```", "", "## Stages", "", *table, "",
              "## CUDA tests (`pytest -p cuda_select -m cuda`)", "", "| test | outcome | s |", "|---|---|---:|"]
    lines += [f"| {n} | {o}{': ' + m.replace('|', '/') if m else ''} | {t:.1f} |" for n, o, t, m in cases]
    lines += ["", "## Benchmarks", "", *eager, "", *comp, ""]
    (outdir / "gpu_report.md").write_text("\n".join(lines) + "\n")
    print(f"gpu_check: {verdict}" + "".join(f"\n  - {p}" for p in problems))
    return 0 if verdict == "PASSED" else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))

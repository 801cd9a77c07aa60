"""The breadth corpus (``tests/_styles``) as tables: every style x preset x seed healthy, and with
``--faults`` every style x supported fault, against this checkout's trackdiag.

Prints (a) a markdown table style x preset -> the warning-or-worse alerts of the healthy runs as
``kind(severity)@step`` per seed (or "none"), and with ``--faults`` (c) a table style x fault -> the
first warning-or-worse alert: ``kind +named/+raised`` (steps after the onset of the step the alert
names / of the logging step that raised it), "missed", or "n/a"; a silent fault's cell (issue 45: ``runaway``,
``detached``, ``frozen_majority``, ``not_landing``, ``eval_wrong``, ``crash_lr``) ends with its verdict (``verdict``:
"caught" when that alert is of the fault's kind and raised within 50 steps of the onset, 100 for one present from
step 0; for ``crash_lr``, when the crash finding leads with the learning-rate jump), and a line above the table
counts them. A ``tiny_subset`` cell (issue 45 item 9) ends with "by 2nd eval", "late +N evals", "missed", "no turn"
or "end" (:func:`turn_verdict`), judged against the turn of the run's validation loss: the first evaluation after
its lowest reading, when the evaluations after it (their median, and the last) stay 5 % or more above it and the
train loss (mean of the every-step loss since the evaluation before) is lower at the last than at the lowest reading
(:func:`turn_of`); a line above the table counts them. ``--json`` writes (b): every alert
(kind, severity, step, where, message, value, threshold), wall and CPU seconds and progress per run,
and for healthy and ``tiny_subset`` runs the every-step series the local record holds (``diag/loss``,
``diag/grad/global_norm``, per component under dict models), per-layer update ratios and eval metrics
at the logging steps: the material to calibrate relative thresholds on.

Usage: python benchmarks/styles_report.py [--styles a,b] [--presets basic,advanced,extreme]
       [--seeds 0,1] [--steps 300] [--faults [f1,f2]] [--fault-level advanced] [--json out.json] [--jobs 1]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import multiprocessing
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's trackdiag, and the corpus

from _styles import STYLE_NAMES, load  # noqa: E402
from _styles._common import ALL_FAULTS, SEVERITY, SILENT_KINDS, START_FAULTS  # noqa: E402

ONSET = 40
#: a silent fault is caught when its first warning-or-worse alert is of the right kind and raised within this many
#: steps of the onset (issue 45: 50, and 100 for a fault present from step 0)
WINDOW, START_WINDOW = 50, 100
#: silent faults that take longer to show by their nature: ``sched_per_batch``'s rate is under 1e-4 of its peak from step
#: 150 and the rule waits until it has stayed there a quarter of the run
WINDOWS = {"sched_per_batch": 250}


def window_of(fault: str) -> int:
    """The steps after the onset within which ``fault`` must be raised to count as caught."""
    return WINDOWS.get(fault, START_WINDOW if fault in START_FAULTS else WINDOW)
#: the rise (over its lowest reading) a validation loss keeps to the end of a ``tiny_subset`` run for it to have turned
TURN_RISE = 0.05


def fault_steps(fault: str, steps: int) -> int:
    """The whole run for the faults judged late (and ``crash_lr``, judged by the crash's text whenever it dies), else
    the onset and 60 steps after it."""
    return steps if fault in ("tiny_subset", "shuffled_labels", "eval_mode", "crash_lr", "sched_per_batch") else \
        min(steps, ONSET + 60)


def verdict(row: dict[str, Any]) -> str:
    """Issue 45's acceptance for a silent fault: "caught" (the first warning-or-worse alert is of the fault's kind and
    raised within the window; ``crash_lr``: the script died and its ``crash`` finding leads with an out-of-scale
    update or a learning-rate jump), else why not. "" for the other faults."""
    fault = row["fault"]
    if fault == "tiny_subset":
        return turn_verdict(row)
    if fault not in SILENT_KINDS:
        return ""
    window = window_of(fault)
    if fault == "crash_lr":
        crash = [a for a in row["alerts"] if a["kind"] == "crash"]
        if not row["error"] or not crash:
            return "no crash"
        msg = crash[-1]["message"]
        lead = msg.startswith("Before the crash, an out-of-scale update") or msg.startswith(
            "Before the crash, a learning-rate jump")
        return "caught" if lead else "crash text leads with: " + msg[:60]
    kinds = SILENT_KINDS[fault]
    kinds = (kinds,) if isinstance(kinds, str) else kinds
    first = row["first"]
    if first is None:
        return "missed"
    if first["kind"] not in kinds:
        return "wrong kind"
    if first["raised_at"] - max(row["onset"], 0) > window:
        return "late"
    return "caught"


def turn_of(row: dict[str, Any]) -> tuple[int, int] | None:
    """The turn of a run's validation loss (``diag/eval/loss`` at the logging steps): the first evaluation after its
    lowest reading, provided the validation loss stayed up and the train loss kept falling: the median of the
    evaluations after the lowest reading, and the last one, are at least ``TURN_RISE`` (5 %) above it (a lone
    lucky reading of a flat, noisy validation loss is no bottom it rose from), and the train loss (the mean of the
    every-step ``diag/loss`` since the evaluation before) is lower at the last evaluation than at the lowest one.
    ``(the turn's index among the evaluations, its step)``; None when there is no turn."""
    series = row.get("series") or {}
    evals = [(int(s), v) for s, v in series.get("logging_steps", {}).get("diag/eval/loss", []) if isinstance(v, float)]
    losses = {int(s): v for s, v in series.get("every_step", {}).get("diag/loss", []) if isinstance(v, float)}
    if len(evals) < 2:
        return None
    vals = [v for _, v in evals]
    m = min(range(len(vals)), key=vals.__getitem__)

    def train_at(i: int) -> float:
        lo = evals[i - 1][0] if i else -1
        pts = [v for s, v in losses.items() if lo < s <= evals[i][0]]
        return sum(pts) / len(pts) if pts else math.nan

    if m == len(vals) - 1 or min(vals[-1], statistics.median(vals[m + 1:])) < vals[m] * (1 + TURN_RISE) or not train_at(len(vals) - 1) < train_at(m):
        return None
    return m + 1, evals[m + 1][0]


def turn_verdict(row: dict[str, Any]) -> str:
    """Issue 45 item 9 for a ``tiny_subset`` row: "by 2nd eval" when the first warning-or-worse alert is
    ``overfitting`` raised no later than the second evaluation after the turn (:func:`turn_of`), "late +N evals"
    when it is raised N evaluations after that one, "missed" (none, or another kind first), "no turn" when the
    validation loss never turned (nothing to raise yet), "end" when the run ends before the second evaluation
    after the turn and nothing was raised."""
    turn = turn_of(row)
    if turn is None:
        return "no turn"
    first = row["first"]
    steps = [int(s) for s, _ in row["series"]["logging_steps"]["diag/eval/loss"]]
    if first is None:
        return "end" if turn[0] + 2 >= len(steps) else "missed"
    if first["kind"] != "overfitting":
        return f"missed ({first['kind']} first)"
    late = sum(s < first["raised_at"] for s in steps[turn[0] + 2:])
    return "by 2nd eval" if late == 0 else f"late +{late} evals"


def _num(v: Any) -> Any:
    return v if not isinstance(v, float) or math.isfinite(v) else str(v)


def _alert(a: Any, raised: int | None = None) -> dict[str, Any]:
    d = {"kind": a.kind, "severity": a.severity, "step": a.step, "where": a.where, "message": a.message,
         "value": _num(a.value) if isinstance(a.value, (int, float)) else a.value,
         "threshold": _num(a.threshold) if isinstance(a.threshold, (int, float)) else a.threshold}
    if raised is not None:
        d["raised_at"] = raised
    return d


def _series(run_dir: Path) -> dict[str, Any]:
    """Every-step series, update ratios and eval metrics from the local record."""
    from trackdiag.core.record import read_records

    series: dict[str, dict[int, float]] = {}
    logged: dict[str, dict[int, float]] = {}
    tables: dict[str, list[Any]] = {}
    for rec in read_records(run_dir):
        for k, pts in rec.series.items():
            series.setdefault(k, {}).update(pts)
        for k, v in rec.scalars.items():
            if "/update/" in k or "/eval/" in k:
                logged.setdefault(k, {})[rec.step] = v
        for k, t in rec.tables.items():
            if "update" in k:
                tables.setdefault(k, []).append([rec.step, {r: _num(v) for r, v in t.items()}])
    pack = lambda d: [[s, _num(v)] for s, v in sorted(d.items())]  # noqa: E731
    return {"every_step": {k: pack(v) for k, v in series.items()}, "logging_steps": {k: pack(v) for k, v in logged.items()},
            "tables": tables}


def _raised(run: Any) -> dict[int, int]:
    """``{id(alert): the logging step whose record first carried it at warning or worse}`` for the warning-or-worse
    alerts, matched on kind, step and where (an info finding at the same step and place raised earlier, like
    ``stale_params``' frozen layers before their stall, is not when the user was warned); -1 if none."""
    from trackdiag.core.record import read_records

    todo: dict[tuple[str, int, str], list[int]] = {}  # several alerts may share kind, step and where
    for a in run.alerts("warning"):
        todo.setdefault((a.kind, a.step, a.where), []).append(id(a))
    out = {i: -1 for ids in todo.values() for i in ids}
    for rec in read_records(run.run_dir):
        for a in rec.alerts:
            ids = todo.get((a.kind, a.step, a.where))
            if ids and out[ids[0]] < 0 and SEVERITY[a.severity] >= SEVERITY["warning"]:
                for i in ids:
                    out[i] = rec.step
    return out


def run_case(job: tuple[str, str, int, str | None, int]) -> dict[str, Any]:
    style, level, seed, fault, steps = job
    logging.getLogger("trackdiag").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    mod = load(style)
    with tempfile.TemporaryDirectory() as tmp:
        t0, c0 = time.perf_counter(), time.process_time()
        run = mod.run(Path(tmp), level=level, seed=seed, steps=steps, fault=fault, onset=ONSET)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        raised = _raised(run)
        first = run.first("warning")
        after = min((a for a in run.alerts("warning") if a.step >= max(run.onset, 0)), key=lambda a: a.step, default=None)
        row: dict[str, Any] = {
            "style": style, "preset": level, "seed": seed, "fault": fault or "healthy", "steps": steps,
            "onset": run.onset, "culprit": run.culprit, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "error": run.error, "disabled_probes": run.diag.summary()["disabled_probes"],
            "progress": None if run.progress is None else {**{k: _num(v) for k, v in vars(run.progress).items()},
                                                          "learned": run.progress.learned},
            "alerts": [_alert(a, raised.get(id(a))) for a in run.diag.alerts],
            "first": None if first is None else _alert(first, raised[id(first)]),
            "first_after_onset": None if after is None else _alert(after, raised[id(after)]),
        }
        if fault in (None, "tiny_subset"):  # tiny_subset: its evaluations find the turn (turn_of)
            row["series"] = _series(run.run_dir)
    return row


def _cell_healthy(rows: list[dict[str, Any]]) -> str:
    parts = []
    for row in sorted(rows, key=lambda r: r["seed"]):
        groups: dict[tuple[str, str], list[int]] = {}
        for a in row["alerts"]:
            if SEVERITY[a["severity"]] >= SEVERITY["warning"]:
                groups.setdefault((a["kind"], a["severity"]), []).append(a["step"])
        text = ", ".join(f"{k}({s})@{','.join(map(str, st))}" for (k, s), st in groups.items()) or "none"
        if row["error"]:
            text += f" [died: {row['error'][:60]}]"
        parts.append(f"s{row['seed']}: {text}")
    return "<br>".join(parts)


def _cell_fault(row: dict[str, Any]) -> str:
    """``kind +named/+raised``; an earlier false alarm is shown before the first alert from the onset on."""
    died = f" (script died: {row['error'].split(':')[0]})" if row["error"] else ""
    onset = row["onset"]

    def fmt(a: dict[str, Any]) -> str:
        where = f" `{a['where'][:40]}`" if row["fault"] in ("nan", "crash_nan") else ""
        return f"{a['kind']} +{a['step'] - onset}/+{a['raised_at'] - onset}{where}"

    first, after = row["first"], row["first_after_onset"]
    judged = verdict(row)
    mark = f" **{judged}**" if judged else ""
    if first is None:
        return f"missed{died}{mark if judged not in ('missed', '') else ''}"
    if first["step"] >= onset:
        return fmt(first) + died + mark
    early = f"before: {first['kind']}@{first['step']}"
    return f"{early}; then {fmt(after) if after else 'missed'}{died}{mark}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--styles", default=",".join(STYLE_NAMES))
    ap.add_argument("--presets", default="basic,advanced,extreme")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--faults", nargs="?", const=",".join(ALL_FAULTS), default=None,
                    help="also run the planted faults (all supported ones, or this comma list)")
    ap.add_argument("--fault-level", default="advanced")
    ap.add_argument("--no-healthy", action="store_true", help="only the faults")
    ap.add_argument("--json", default=None)
    ap.add_argument("--jobs", type=int, default=1, help="cases at once, each worker a fresh process")
    args = ap.parse_args()
    styles = args.styles.split(",")
    presets = args.presets.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs: list[tuple[str, str, int, str | None, int]] = []
    if not args.no_healthy:
        jobs += [(s, p, seed, None, args.steps) for s in styles for p in presets for seed in seeds]
    faults = args.faults.split(",") if args.faults else []
    jobs += [(s, args.fault_level, 0, f, fault_steps(f, args.steps)) for s in styles for f in faults
             if f in load(s).FAULTS]
    t0 = time.perf_counter()
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            rows = pool.map(run_case, jobs, chunksize=1)
    else:
        rows = []
        for job in jobs:
            rows.append(run_case(job))
            r = rows[-1]
            what = _cell_healthy([r]) if r["fault"] == "healthy" else _cell_fault(r)
            print(f"# {r['style']:24} {r['preset']:8} seed={r['seed']} {r['fault']:16} {r['wall_s']:6.2f}s "
                  f"cpu {r['cpu_s']:5.2f}s {what}", file=sys.stderr, flush=True)
    total = time.perf_counter() - t0
    healthy = [r for r in rows if r["fault"] == "healthy"]
    if healthy:
        print(f"\n### Healthy runs: warning-or-worse alerts ({args.steps} steps, seeds {args.seeds})\n")
        print("| style | " + " | ".join(presets) + " |")
        print("|---|" + "---|" * len(presets))
        for s in styles:
            cells = [_cell_healthy([r for r in healthy if r["style"] == s and r["preset"] == p]) for p in presets]
            print(f"| {s} | " + " | ".join(cells) + " |")
        by_preset = {p: sum(r["wall_s"] for r in healthy if r["preset"] == p) for p in presets}
        print(f"\nwall seconds per preset: {json.dumps({p: round(v, 1) for p, v in by_preset.items()})}")
    fault_rows = [r for r in rows if r["fault"] != "healthy"]
    if fault_rows:
        cols = [f for f in ALL_FAULTS if f in faults]
        silent = [f for f in cols if f in SILENT_KINDS]
        if silent:
            tally = {f: (sum(verdict(r) == "caught" for r in fault_rows if r["fault"] == f),
                         sum(r["fault"] == f for r in fault_rows)) for f in silent}
            print("\nsilent faults caught (right kind, in the window): "
                  + ", ".join(f"{f} {c}/{n}" for f, (c, n) in tally.items()))
        turns = [turn_verdict(r) for r in fault_rows if r["fault"] == "tiny_subset"]
        if turns:
            with_turn = [t for t in turns if t not in ("no turn", "end")]
            print(f"\ntiny_subset raised by the 2nd evaluation after the turn: {turns.count('by 2nd eval')}/{len(with_turn)}"
                  f" with a turn (later {sum(t.startswith('late') for t in turns)}, missed {sum(t.startswith('missed') for t in turns)}); "
                  f"no turn {turns.count('no turn')}, turn too close to the end {turns.count('end')}")
        print(f"\n### Planted faults at step {ONSET} (`{args.fault_level}`, seed 0): first warning-or-worse alert, "
              "+steps to the step named / to the logging step that raised it\n")
        print("| style | " + " | ".join(cols) + " |")
        print("|---|" + "---|" * len(cols))
        for s in styles:
            cells = []
            for f in cols:
                match = [r for r in fault_rows if r["style"] == s and r["fault"] == f]
                cells.append(_cell_fault(match[0]) if match else "n/a")
            print(f"| {s} | " + " | ".join(cells) + " |")
    print(f"\n{len(rows)} runs in {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "onset": ONSET, "seconds": round(total, 1),
                                               "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

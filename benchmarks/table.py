"""The benchmark's numbers and tables: paired per-round ratios with a 95 % interval, one row per arm
(a dict, also what ``--json`` writes), its console line and the README's markdown table."""
from __future__ import annotations

import math
import statistics
from typing import Any


def paired_ratio(arm: list[float], bare: list[float]) -> tuple[float, float]:
    """Median of the per-round ratios, and the half-width of a 95 % interval (1.96 standard errors
    of the mean log ratio, scaled to the ratio)."""
    ratios = [a / b for a, b in zip(arm, bare)]
    if not ratios:
        return math.nan, math.nan
    logs = [math.log(r) for r in ratios]
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.nan
    mid = statistics.median(ratios)
    return mid, mid * half


def row_of(label: str, arm: Any, bare: Any, compiled: bool) -> dict[str, Any]:
    r: dict[str, Any] = {"workload": label, "arm": arm.name, "error": arm.error, "notes": arm.notes[-3:]}
    if compiled:
        alone = arm.alone or [0, 0, 0, 0]
        r.update(graph_breaks=alone[0], unique_graphs=alone[1], frames_compiled=alone[2], recompile_limit_hits=alone[3],
                 frames_compiled_while_timed=arm.dyn[2])
    if arm.cockpit is not None:
        r["cockpit_quantities"] = getattr(arm, "cockpit_quantities", [])
    if arm.error or bare.error or not arm.walls:
        return r
    bare_ms = 1e3 * statistics.median(bare.walls)
    rt, ci = paired_ratio(arm.walls, bare.walls)
    rc, _ = paired_ratio(arm.cpu, bare.cpu)
    r.update(ms=1e3 * statistics.median(arm.walls), ratio=rt, ci=ci, cpu_ms=1e3 * statistics.median(arm.cpu), cpu_ratio=rc,
             own_ms=arm.attributed, attributed=1.0 + arm.attributed / bare_ms, rounds=len(arm.walls))
    return r


def line_of(r: dict[str, Any]) -> str:
    head = f"{r['workload']:24s} {r['arm']:12s}"
    if "ms" not in r:
        return f"{head} FAILED: {r['error'] or 'the bare arm failed'}"
    s = f"{head} {r['ms']:8.2f} ms/step  x{r['ratio']:.3f} ±{r['ci']:.3f}   cpu {r['cpu_ms']:8.2f} ms/step  x{r['cpu_ratio']:.3f}"
    if r["own_ms"] == r["own_ms"]:
        s += f"   own {r['own_ms']:6.3f} ms/step  x{r['attributed']:.3f}"
    if "graph_breaks" in r:
        s += f"   dynamo: {r['graph_breaks']} breaks, {r['unique_graphs']} graphs, {r['frames_compiled']} frames" + (
            f", {r['recompile_limit_hits']} recompile-limit hits" if r["recompile_limit_hits"] else "") + (
            f", {r['frames_compiled_while_timed']} frames compiled while timed" if r["frames_compiled_while_timed"] else "")
    if "cockpit_quantities" in r:
        s += f"   cockpit logged: {', '.join(r['cockpit_quantities'])}"
    return s


def markdown(rows: list[dict[str, Any]], compiled: bool) -> str:
    dyn = " graph breaks / graphs / frames |" if compiled else ""
    out = ["| workload | arm | ms/step | wall ratio (95 %) | CPU ratio | own ms/step | attributed ratio |" + dyn,
           "|---|---|---:|---:|---:|---:|---:|" + ("---:|" if compiled else "")]
    for r in rows:
        d = ""
        if compiled and "graph_breaks" in r:
            d = (f" {r['graph_breaks']} / {r['unique_graphs']} / {r['frames_compiled']}{' (limit hit)' if r['recompile_limit_hits'] else ''}"
                 f"{' (+' + str(r['frames_compiled_while_timed']) + ' timed)' if r['frames_compiled_while_timed'] else ''} |")
        elif compiled:
            d = " – |"
        if "ms" not in r:
            out.append(f"| {r['workload']} | {r['arm']} | failed: {(r['error'] or 'bare failed').replace('|', '/')} | | | | |{d}")
            continue
        own = f"{r['own_ms']:.3f} | {r['attributed']:.3f}" if r["own_ms"] == r["own_ms"] else "– | –"
        out.append(f"| {r['workload']} | {r['arm']} | {r['ms']:.2f} | {r['ratio']:.3f} ±{r['ci']:.3f} | {r['cpu_ratio']:.3f} | {own} |{d}")
    return "\n".join(out)

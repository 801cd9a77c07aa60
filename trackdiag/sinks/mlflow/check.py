"""Checks for spools read back from disk: a spool may have been written by someone else.

``trackdiag sync`` and the background delivery of leftover spools never trust a spool's content:
:func:`check_op` refuses an op that is not exactly what the MLflow sink writes (types, sizes,
statuses) and any ``artifact`` op whose file, after following symlinks, is not inside the run dir
the spool belongs to (so a crafted spool cannot upload ``~/.netrc``); :func:`check_state` does
the same for ``meta.json``'s run state. Costs a ``stat``/``realpath`` per artifact file.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from trackdiag.sinks.mlflow.ops import MAX_KEY, MAX_PARAM_VALUE, MAX_PARAMS_TAGS, MAX_TAG_VALUE

STATUSES = ("FINISHED", "FAILED", "KILLED")
_ID = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
_ARTIFACT_DIR = re.compile(r"^[A-Za-z0-9_\-. /]{1,200}$")
_MAX_TEXT = 4096
_MAX_BINS = 100_000


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text(v: Any, limit: int = _MAX_TEXT, optional: bool = True) -> bool:
    return (v is None and optional) or (isinstance(v, str) and len(v) <= limit)


def inside(path: Path, root: Path) -> bool:
    """True if ``path`` (symlinks followed) is ``root`` or below it (``root`` resolved too)."""
    try:
        real, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
    except (OSError, ValueError):
        return False
    return real == base or base in real.parents


def _artifact_problem(op: dict[str, Any], run_dir: Path) -> str | None:
    path, folder = op.get("path"), op.get("dir")
    if not isinstance(path, str) or not path or "\0" in path:
        return "artifact: no path"
    if folder is not None and (not isinstance(folder, str) or not _ARTIFACT_DIR.match(folder)
                               or folder.startswith("/") or ".." in folder.split("/")):
        return f"artifact: bad artifact dir {folder!r}"
    p = Path(path)
    if not p.is_absolute() or not inside(p, run_dir):
        return f"artifact: {path} is outside the run dir {run_dir}"
    if p.is_dir():
        for f in p.rglob("*"):
            if not inside(f, run_dir):
                return f"artifact: {f} (in {path}) is outside the run dir {run_dir}"
    return None


def _records_problem(records: Any) -> str | None:
    if not isinstance(records, list):
        return "points: records is not a list"
    for rec in records:
        if not (isinstance(rec, list) and len(rec) == 4 and _is_int(rec[0]) and _is_int(rec[1])
                and isinstance(rec[2], dict) and isinstance(rec[3], dict)):
            return "points: a record is not [step, timestamp, scalars, series]"
        step, ts, scalars, series = rec
        if not all(isinstance(k, str) and len(k) <= _MAX_TEXT and _is_num(v) for k, v in scalars.items()):
            return "points: a scalar is not key -> number"
        for k, pts in series.items():
            if not (isinstance(k, str) and len(k) <= _MAX_TEXT and isinstance(pts, list)
                    and all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and _is_num(p[1]) for p in pts)):
                return "points: a series is not key -> [[step, value], ...]"
    return None


def check_op(op: Any, run_dir: Path) -> str | None:
    """Why ``op`` must not be delivered, or None if it is a well-formed op of the sink whose files
    (if any) lie inside ``run_dir``."""
    if not isinstance(op, dict):
        return "not an op"
    kind = op.get("op")
    if kind == "open":
        spec = op.get("spec")
        if not isinstance(spec, dict) or not _text(spec.get("experiment"), 500, optional=False) or not spec["experiment"]:
            return "open: no experiment"
        if not all(_text(spec.get(k)) for k in ("run_name", "artifact_location", "group", "source")):
            return "open: a field is not text"
        if spec.get("attach_run_id") is not None and not (isinstance(spec["attach_run_id"], str)
                                                          and _ID.match(spec["attach_run_id"])):
            return "open: bad attach_run_id"
        if spec.get("start_ms") is not None and not _is_int(spec["start_ms"]):
            return "open: bad start_ms"
        group = spec.get("group")
        if group is not None and not (Path(group).is_absolute() and inside(run_dir, Path(group))):
            return f"open: sweep dir {group!r} does not hold the run dir {run_dir}"  # its lock file goes there
        return None
    if kind == "points":
        return _records_problem(op.get("records"))
    if kind in ("params", "tags"):
        items, limit = op.get("items"), MAX_PARAM_VALUE if kind == "params" else MAX_TAG_VALUE
        if not (isinstance(items, list) and len(items) <= MAX_PARAMS_TAGS and all(
                isinstance(i, list) and len(i) == 2 and _text(i[0], MAX_KEY, False) and _text(i[1], limit, False)
                for i in items)):
            return f"{kind}: items are not <= {MAX_PARAMS_TAGS} [key, value] pairs of text"
        return None
    if kind == "artifact":
        return _artifact_problem(op, run_dir)
    if kind == "image":
        edges, counts = op.get("edges"), op.get("counts")
        if not (_text(op.get("title"), optional=False) and _is_int(op.get("step")) and _is_int(op.get("ts"))
                and isinstance(edges, list) and isinstance(counts, list) and len(edges) <= _MAX_BINS
                and len(counts) <= _MAX_BINS and all(map(_is_num, edges)) and all(map(_is_num, counts))):
            return "image: bad title, step, timestamp, edges or counts"
        return None
    if kind == "key_map":
        return None
    if kind == "end":
        if op.get("status") not in STATUSES or not (op.get("ts") is None or _is_int(op.get("ts"))):
            return f"end: status must be one of {', '.join(STATUSES)}"
        return None
    return f"unknown op {str(kind)[:40]!r}"


def check_state(state: Any, run_dir: Path) -> str | None:
    """Why a spool's ``meta.json`` run state is unusable, or None."""
    if not isinstance(state, dict):
        return "meta.json: no run state"
    if not _text(state.get("tracking_uri"), 2000, optional=False) or not state["tracking_uri"]:
        return "meta.json: no tracking URI"
    for key in ("run_id", "parent_run_id", "experiment_id"):
        if state.get(key) is not None and not (isinstance(state[key], str) and _ID.match(state[key])):
            return f"meta.json: bad {key}"
    if state.get("spec") is not None and check_op({"op": "open", "spec": state["spec"]}, run_dir) is not None:
        return "meta.json: bad run spec"
    return None


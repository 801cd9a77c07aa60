"""Bounded, type-checked reads of the files ``compare`` and ``summary`` take from run dirs.

Run dirs may be half-written, hand-edited, or hostile: every read here is capped in size
(:data:`MAX_JSON_BYTES` per JSON file, :data:`MAX_LINE_BYTES` per JSON line, :data:`MAX_YAML_BYTES`
per YAML file), in nesting (:data:`MAX_DEPTH`), accepts regular files only (a FIFO or device named
``run.json`` is refused, never read), and YAML with anchors/aliases is refused (no "billion laughs").
A file that breaks a rule raises :class:`UnreadableFile` with one line saying why; the caller skips
that run dir with that line. Values read are type-checked (:func:`as_int`...) and long text is cut
early (:func:`clip`), so later stages never see a 30 MB string. Cost: linear in the bytes read.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, Iterator, Mapping

MAX_JSON_BYTES = 64 * 2**20
MAX_LINE_BYTES = 16 * 2**20
MAX_YAML_BYTES = 4 * 2**20
MAX_DEPTH = 64
MAX_TEXT = 200
MAX_KINDS = 200


class UnreadableFile(ValueError):
    """A run-dir file that is too big, too deep, not JSON/YAML, or holds a value of the wrong type."""


def read_bytes(path: Path, limit: int) -> bytes | None:
    """The file's bytes; None if it does not exist. Raises :class:`UnreadableFile` if it is not a
    regular file or holds more than ``limit`` bytes."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UnreadableFile(f"{path.name}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnreadableFile(f"{path.name}: not a regular file")
    if st.st_size > limit:
        raise UnreadableFile(f"{path.name}: {st.st_size / 2**20:.1f} MB, over the {limit / 2**20:.0f} MB limit")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise UnreadableFile(f"{path.name}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise UnreadableFile(f"{path.name}: over the {limit / 2**20:.0f} MB limit")
    return data


def read_json(path: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """Parsed JSON of ``path``, None if missing; :class:`UnreadableFile` if too big, invalid or too deep."""
    data = read_bytes(path, limit)
    if data is None:
        return None
    return parse_json(data, path.name)


def parse_json(data: bytes | str, what: str) -> Any:
    """``json.loads`` with the depth cap; :class:`UnreadableFile` instead of any parse error."""
    try:
        obj = json.loads(data)
    except RecursionError:
        raise UnreadableFile(f"{what}: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise UnreadableFile(f"{what}: not valid JSON ({str(exc)[:100]})") from None
    check_depth(obj, what)
    return obj


def check_depth(obj: Any, what: str, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`UnreadableFile` if containers nest deeper than ``limit`` (iterative, linear)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > limit:
                raise UnreadableFile(f"{what}: nested deeper than {limit} levels")
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))


def iter_json_lines(path: Path, needles: tuple[bytes, ...] = ()) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one line at a time (missing file: nothing).

    Lines longer than :data:`MAX_LINE_BYTES`, torn, invalid, too deep or not objects are skipped;
    with ``needles`` only lines containing one of them are parsed.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return
        f = open(path, "rb")
    except OSError:
        return
    with f:
        while line := f.readline(MAX_LINE_BYTES + 1):
            if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
                while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                    pass
                continue
            if needles and not any(n in line for n in needles):
                continue
            try:
                obj = parse_json(line, path.name)
            except UnreadableFile:
                continue
            if isinstance(obj, dict):
                yield obj


def read_yaml(path: Path, limit: int = MAX_YAML_BYTES) -> Any:
    """Parsed YAML (safe loader) of ``path``, None if missing; :class:`UnreadableFile` if too big,
    invalid, using anchors/aliases, or too deep."""
    import yaml

    data = read_bytes(path, limit)
    if data is None:
        return None
    try:
        if any(isinstance(t, (yaml.AliasToken, yaml.AnchorToken)) for t in yaml.scan(data, Loader=yaml.SafeLoader)):
            raise UnreadableFile(f"{path.name}: YAML anchors/aliases are not accepted here")
        obj = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        raise UnreadableFile(f"{path.name}: not valid YAML ({str(exc).splitlines()[0][:100]})") from None
    except RecursionError:
        raise UnreadableFile(f"{path.name}: nested deeper than {MAX_DEPTH} levels") from None
    check_depth(obj, path.name)
    return obj


def clip(text: str, limit: int = MAX_TEXT) -> str:
    """``text`` if short, else its head and a hash of the whole (distinct values stay distinct)."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode("utf-8", "replace")).hexdigest()[:8]
    return f"{text[: limit - 12]}...#{digest}"


def clip_value(value: Any) -> Any:
    """Numbers, booleans, None and short lists/objects as they are; long text clipped; long or
    odd containers as their clipped JSON text."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return clip(value)
    try:
        text = json.dumps(value, default=str)
    except (TypeError, ValueError, RecursionError):
        return clip(type(value).__name__)
    return value if len(text) <= MAX_TEXT and isinstance(value, (list, dict)) else clip(text)


def as_int(value: Any, what: str) -> int | None:
    """``value`` as an int (None stays None; an integral finite float is accepted)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    raise UnreadableFile(f"{what} must be an integer, got {clip(repr(value), 60)}")


def as_float(value: Any, what: str) -> float | None:
    """``value`` as a float (None stays None; NaN/Inf kept)."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise UnreadableFile(f"{what} must be a number, got {clip(repr(value), 60)}")


def as_str(value: Any, what: str, default: str | None = None) -> str | None:
    """``value`` as clipped text (None: ``default``); numbers are accepted as text."""
    if value is None:
        return default
    if isinstance(value, str):
        return clip(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise UnreadableFile(f"{what} must be a string, got {clip(repr(value), 60)}")


def as_dict(value: Any, what: str) -> dict[str, Any]:
    """``value`` as a dict (None: empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise UnreadableFile(f"{what} must be an object, got {type(value).__name__}")
    return dict(value)


def normalise_summary(obj: Any, what: str = "summary.json") -> dict[str, Any]:
    """A type-checked copy of a session summary (``summary.json``) with every field the console
    table and ``compare`` read; raises :class:`UnreadableFile` naming the first bad field."""
    d = as_dict(obj, what)
    alerts: dict[str, dict[str, Any]] = {}
    for kind, a in list(as_dict(d.get("alerts"), f"{what}: alerts").items())[:MAX_KINDS]:
        where = f"{what}: alerts.{clip(str(kind), 60)}"
        a = as_dict(a, where)
        alerts[clip(str(kind), 100)] = {
            "count": as_int(a.get("count", 0), f"{where}.count") or 0,
            "first_step": as_int(a.get("first_step"), f"{where}.first_step"),
            "suppressed": as_int(a.get("suppressed", 0), f"{where}.suppressed") or 0,
            "severity": as_str(a.get("severity"), f"{where}.severity", "warning"),
            "first_where": as_str(a.get("first_where"), f"{where}.first_where", ""),
        }
    overhead = as_dict(d.get("overhead"), f"{what}: overhead")
    return {
        "steps": as_int(d.get("steps"), f"{what}: steps"),
        "health": as_str(d.get("health"), f"{what}: health", None),
        "level": as_str(d.get("level"), f"{what}: level", ""),
        "run_name": as_str(d.get("run_name"), f"{what}: run_name", ""),
        "alerts": alerts,
        "overhead": {k: as_float(overhead.get(k), f"{what}: overhead.{k}") or 0.0
                     for k in ("seconds", "per_step_ms", "fraction")},
        "output_dir": as_str(d.get("output_dir"), f"{what}: output_dir", ""),
    }

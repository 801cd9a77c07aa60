"""Make a user's hyperparameters safe to log: plain containers, string keys, no cycles, bounded size.

:func:`to_plain_tolerant` turns an OmegaConf node into plain containers, resolving every
interpolation it can; one that fails (``${oc.env:UNSET}``, ``${missing}``, ``???``) is kept as its
text in an :class:`Unresolved` string that carries the error. :func:`sanitize` then gives every sink
the same JSON-able data: keys stringified (``(1, 2)`` -> ``"(1, 2)"``, ``None`` -> ``"None"``),
circular references and levels past :data:`MAX_DEPTH` replaced by a marker, strings cut at
:data:`MAX_STR` characters, other objects as their (cut) ``str``, each change listed in a note.
Cost: one walk over the data; linear in its size.
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
from pathlib import PurePath
from typing import Any, Mapping

MAX_DEPTH = 64
MAX_STR = 100_000
MAX_OBJ_STR = 1_000


class Unresolved(str):
    """The text of an OmegaConf value that could not be resolved; ``error`` says why."""

    error: str

    def __new__(cls, text: str, error: str) -> "Unresolved":
        obj = super().__new__(cls, text)
        obj.error = error
        return obj

    def __reduce__(self) -> tuple[Any, ...]:  # deepcopy and pickle keep the error
        return (Unresolved, (str(self), self.error))


def to_plain_tolerant(cfg: Any) -> Any:
    """An OmegaConf node as plain containers; unresolvable values become :class:`Unresolved`.

    Anything that is not an OmegaConf node is returned as is. Never raises for bad interpolations.
    """
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:
        return cfg
    if not isinstance(cfg, (DictConfig, ListConfig)):
        return cfg
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # one bad interpolation somewhere: walk the node value by value
        return _walk(cfg, 0)


def _walk(node: Any, depth: int) -> Any:
    from omegaconf import DictConfig, ListConfig

    if isinstance(node, DictConfig):
        try:
            keys = list(node.keys())
        except Exception as exc:  # the node itself is an unresolvable interpolation
            return _unresolved(node, None, exc)
        return {k: _child(node, k, depth) for k in keys}
    if isinstance(node, ListConfig):
        try:
            n = len(node)
        except Exception as exc:
            return _unresolved(node, None, exc)
        return [_child(node, i, depth) for i in range(n)]
    return node


def _child(node: Any, key: Any, depth: int) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    try:
        value = node[key]
    except Exception as exc:
        return _unresolved(node, key, exc)
    if isinstance(value, (DictConfig, ListConfig)):
        if depth >= MAX_DEPTH:
            return Unresolved("<too deep>", f"nested deeper than {MAX_DEPTH} levels")
        try:
            return OmegaConf.to_container(value, resolve=True)
        except Exception:
            return _walk(value, depth + 1)
    return value


def _unresolved(node: Any, key: Any, exc: Exception) -> Unresolved:
    """The raw text of ``node[key]`` (``${...}`` or ``???``) with the resolution error."""
    try:
        child = node._get_node(key) if key is not None else node
        raw = child._value() if child is not None else "???"
    except Exception:  # omegaconf internals moved: say what we can
        raw = "???"
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return Unresolved(str(raw), f"{type(exc).__name__}: {message}"[:500])


def sanitize(obj: Any) -> tuple[Any, list[str]]:
    """(JSON-able copy of ``obj``, notes on what was changed). See the module docstring."""
    notes: list[str] = []
    return _clean(obj, "", set(), 0, notes), notes


def _clean(v: Any, path: str, active: set[int], depth: int, notes: list[str]) -> Any:
    where = path or "(root)"
    if isinstance(v, Unresolved):
        notes.append(f"{where}: unresolvable interpolation kept as text {str(v)[:200]!r} ({v.error})")
        return str(v)
    if isinstance(v, str):
        if len(v) > MAX_STR:
            notes.append(f"{where}: string of {len(v)} characters cut to {MAX_STR}")
            return f"{v[:MAX_STR]}...[{len(v) - MAX_STR} more characters]"
        return str(v)
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, (int, float)):
        return float(v) if isinstance(v, float) else int(v)
    if isinstance(v, PurePath):
        return str(v)
    if type(v).__module__.startswith("omegaconf"):  # a DictConfig nested in plain containers
        v = to_plain_tolerant(v)
        if isinstance(v, str) or not isinstance(v, (Mapping, list)):
            return _clean(v, path, active, depth, notes)
    container = _items(v)
    if container is None and not isinstance(v, (list, tuple, set, frozenset)):
        return _scalar(v, where, notes)
    if depth >= MAX_DEPTH:
        notes.append(f"{where}: nested deeper than {MAX_DEPTH} levels; the rest is cut")
        return "<too deep>"
    if id(v) in active:
        notes.append(f"{where}: circular reference replaced by a marker")
        return "<circular reference>"
    active.add(id(v))
    try:
        if container is not None:
            out: dict[str, Any] = {}
            for k, x in container:
                ks = _key(k, out, where, notes)
                out[ks] = _clean(x, f"{path}.{ks}" if path else ks, active, depth + 1, notes)
            return out
        items = sorted(v, key=repr) if isinstance(v, (set, frozenset)) else v
        return [_clean(x, f"{path}[{i}]", active, depth + 1, notes) for i, x in enumerate(items)]
    finally:
        active.discard(id(v))


def _items(v: Any) -> list[tuple[Any, Any]] | None:
    """Key/value pairs of a mapping, ``argparse.Namespace`` or dataclass instance, else None."""
    if isinstance(v, Mapping):
        return list(v.items())
    if isinstance(v, argparse.Namespace):
        return list(vars(v).items())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return [(f.name, getattr(v, f.name, None)) for f in dataclasses.fields(v)]
    return None


def _key(k: Any, taken: Mapping[str, Any], where: str, notes: list[str]) -> str:
    """A string key; non-string keys stringified (noted unless int), clashes made unique."""
    if isinstance(k, str):
        ks = str(k)
    else:
        ks = str(k)[:MAX_OBJ_STR]
        if not isinstance(k, int) or isinstance(k, bool):
            notes.append(f"{where}: {type(k).__name__} key {ks!r} stringified")
    while ks in taken:
        ks = f"{ks} ({type(k).__name__})"
    return ks


def _scalar(v: Any, where: str, notes: list[str]) -> Any:
    """Numbers from numpy/torch scalars; anything else as its cut ``str``."""
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
        try:
            item = v.item()
            if isinstance(item, (bool, int, float, str)):
                return item
        except Exception:  # noqa: BLE001 - an odd object; fall back to its text
            pass
    try:
        text = str(v)
    except Exception as exc:  # noqa: BLE001 - a __str__ that raises
        text = f"<{type(v).__name__}: str() failed: {type(exc).__name__}>"
    if len(text) > MAX_OBJ_STR:
        notes.append(f"{where}: {type(v).__name__} logged as its text, cut to {MAX_OBJ_STR} characters")
        text = text[:MAX_OBJ_STR] + "..."
    return text

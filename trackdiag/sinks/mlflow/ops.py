"""MLflow-safe keys and values, and the plain-JSON "ops" the MLflow sink queues, spools and sends.

An op is a dict that survives a round trip through JSON (the spool on disk):

- ``{"op": "open", "spec": {...}}``: find or create the experiment, the sweep parent and the run.
- ``{"op": "points", "records": [[step, timestamp_ms, {key: value}, {key: [[step, value], ...]}], ...]}``:
  the scalars and series of records as the session made them (original keys); the runner maps
  the keys and sends them in ``log_batch`` calls of <= 1000 points and < 1 MB.
- ``{"op": "params", "items": [[key, value], ...]}`` / ``{"op": "tags", ...}`` (<= 100 each).
- ``{"op": "artifact", "path": local_file, "dir": artifact_dir | None}``.
- ``{"op": "image", "title": original key, "edges": [...], "counts": [...], "step": step, "ts": ms}``:
  a histogram, rendered and sent with ``log_image`` (key = the mapped key) by the runner.
- ``{"op": "key_map"}``: upload ``trackdiag/key_map.json`` (the keys the runner renamed).
- ``{"op": "end", "status": "FINISHED" | "FAILED" | "KILLED", "ts": ms}``.

Key mapping (:func:`sanitize_key`): MLflow accepts ``A-Z a-z 0-9 _ - . / space`` (plus ``:``
except on Windows servers, so we drop it too). Every other character becomes ``_``; empty,
``.`` and ``..`` path segments are removed or become ``_``/``__``; keys over 250 characters are
cut and suffixed with 8 hex digits of their hash. ``(root)`` -> ``_root_``,
``blocks[3].attn`` -> ``blocks_3_.attn``. :class:`KeyMap` keeps the mapping collision-free.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from typing import Any, Iterable, Iterator, Mapping

log = logging.getLogger("trackdiag")

MAX_KEY = 250            # MLflow MAX_ENTITY_KEY_LENGTH
MAX_PARAM_VALUE = 6000   # MAX_PARAM_VAL_LENGTH
MAX_TAG_VALUE = 8000     # MAX_TAG_VAL_LENGTH
MAX_METRICS = 1000       # MAX_METRICS_PER_BATCH
MAX_PARAMS_TAGS = 100    # MAX_PARAMS_TAGS_PER_BATCH
MAX_BYTES = 900_000      # under MAX_BATCH_LOG_REQUEST_SIZE (1e6), with room for the envelope

_BAD = re.compile(r"[^A-Za-z0-9_\-./ ]")
# MLflow error codes that will never succeed on retry: drop the op (kept in rejected.jsonl).
_PERMANENT = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
    "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED", "FEATURE_DISABLED", "ENDPOINT_NOT_FOUND",
    "MALFORMED_REQUEST", "INVALID_REQUEST",
})


def sanitize_key(key: str) -> str:
    """``key`` as a valid, normalised MLflow metric/param/tag/image key (see module doc)."""
    s = _BAD.sub("_", str(key))
    parts = [("_" * len(p) if p in (".", "..") else p) for p in s.split("/") if p]
    s = "/".join(parts) or "_"
    if len(s) > MAX_KEY:
        s = s[: MAX_KEY - 9] + "_" + hashlib.sha1(key.encode()).hexdigest()[:8]
    return s


class KeyMap:
    """Original key -> MLflow key, cached, collision-free (a clash gets ``_2``, ``_3`` ...).

    ``changed`` holds every key that was altered (logged as ``trackdiag/key_map.json``).
    Costs one dict lookup per point once a key has been seen.
    """

    def __init__(self) -> None:
        self._map: dict[str, str] = {}
        self._used: set[str] = set()
        self.changed: dict[str, str] = {}

    def __call__(self, key: str) -> str:
        out = self._map.get(key)
        if out is not None:
            return out
        out = base = sanitize_key(key)
        n = 1
        while out in self._used:
            n += 1
            out = f"{base[: MAX_KEY - 6]}_{n}"
        self._map[key] = out
        self._used.add(out)
        if out != key:
            self.changed[key] = out
            log.debug("trackdiag: MLflow key %r logged as %r", key, out)
        return out


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> ``{"a.b.c": "value"}``; lists as JSON, values cut to MLflow's limit."""
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key))
        else:
            text = json.dumps(v, default=str) if isinstance(v, (list, tuple, Mapping)) else str(v)
            out[key] = text[:MAX_PARAM_VALUE]
    return out


def user_params(params: dict[str, str], level: str) -> dict[str, str]:
    """``params`` (a flattened config) without the ``diag.*`` entries that only repeat preset ``level``:
    a Hydra user's ``hparams=cfg`` carries the whole ``diag`` node (130-odd keys for one preset),
    which would bury the user's own hyperparameters in MLflow's params table, run comparison and
    image cards. ``diag.level`` and every value the user changed stay; the whole preset is in the
    ``trackdiag/diag_config.yaml`` artifact."""
    if not any(k.startswith("diag.") for k in params):
        return params
    try:
        from trackdiag.core.presets import load_preset

        preset = flatten({"diag": {**load_preset(level), "level": level}})
    except Exception:  # noqa: BLE001 - an unknown level: keep everything
        return params
    return {k: v for k, v in params.items() if k == "diag.level" or not k.startswith("diag.") or preset.get(k) != v}


def chunk_metrics(items: list[Any], key_len: Any = len) -> Iterator[list[Any]]:
    """Split metrics into ``log_batch``-sized lists: <= 1000 each and under ~0.9 MB of JSON
    (~80 bytes per point plus its key; ``key_len(item)`` gives the key's length)."""
    for i in range(0, len(items), MAX_METRICS):
        chunk = items[i : i + MAX_METRICS]
        if sum(key_len(it) for it in chunk) + 80 * len(chunk) <= MAX_BYTES:
            yield chunk
            continue
        part: list[Any] = []
        size = 0
        for item in chunk:  # long keys: split by size
            est = key_len(item) + 80
            if part and size + est > MAX_BYTES:
                yield part
                part, size = [], 0
            part.append(item)
            size += est
        if part:
            yield part


def pair_ops(kind: str, pairs: Iterable[tuple[str, str]]) -> Iterator[dict[str, Any]]:
    """``params``/``tags`` ops of at most 100 pairs, keys sanitised, values cut to the limit."""
    limit = MAX_PARAM_VALUE if kind == "params" else MAX_TAG_VALUE
    items = [[sanitize_key(k), str(v)[:limit]] for k, v in pairs]
    for i in range(0, len(items), MAX_PARAMS_TAGS):
        yield {"op": kind, "items": items[i : i + MAX_PARAMS_TAGS]}


def op_size(op: Mapping[str, Any]) -> int:
    """Number of entities an op carries (metric points, params, tags; 1 otherwise)."""
    if op.get("op") == "points":
        return sum(len(sc) + sum(len(p) for p in se.values()) for _, _, sc, se in op["records"])
    items = op.get("items")
    return len(items) if isinstance(items, list) else 1


def is_permanent(exc: BaseException) -> bool:
    """True if retrying ``exc`` cannot help (bad request, missing run); False for outages."""
    flag = getattr(exc, "permanent", None)  # classified in the worker process already
    if isinstance(flag, bool):
        return flag
    code = getattr(exc, "error_code", None)
    if isinstance(code, str) and code:
        return code in _PERMANENT
    return isinstance(exc, (ValueError, TypeError, KeyError, AttributeError, FileNotFoundError))


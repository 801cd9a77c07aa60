"""Value checks behind :func:`trackdiag.config.load.validate`: types, ranges, targets, interpolations.

Every function returns a list of problem lines (``path: what is wrong, got value``) and never
raises, so validation can report every problem at once. Ranges are keyed by option name (the same
name means the same thing in every probe, rule and sink: ``window``, ``patience``, ``factor``...);
an option not listed must be finite and, when its default is >= 0, not negative.
Cost: microseconds per option; done once per session, before anything is hooked.
"""
from __future__ import annotations

import math
import typing
from typing import Any, Callable, Mapping

from trackdiag.util.sanitize import Unresolved

_UnionType = type(int | None)
INT_LIMIT = 2**31 - 1  # larger counts overflow C sizes (deque maxlen, tensor sizes) or mean a typo

# option name -> (low, low inclusive, high, high inclusive); None: unbounded on that side
Range = tuple[float | None, bool, float | None, bool]
_AT_LEAST_1: Range = (1, True, None, False)
_AT_LEAST_0: Range = (0, True, None, False)
_POSITIVE: Range = (0, False, None, False)
_FRACTION: Range = (0, False, 1, True)
_UNIT: Range = (0, True, 1, True)
RANGES: dict[str, Range] = {
    **dict.fromkeys(("every", "window", "ring", "steps", "bins", "dims", "max_groups", "max_evals", "max_calls",
                     "max_samples", "max_features", "max_memory_batches", "max_backoff_streak", "accumulation_steps",
                     "history", "max_layer_metrics", "max_alerts_per_rule", "min_points",
                     "min_batches", "min_samples", "max_bins"), _AT_LEAST_1),
    **dict.fromkeys(("patience", "patience_steps", "warmup", "cooldown", "min_steps", "max_replays",
                     "memory_snapshot_steps", "anomaly_window", "max_histogram_images", "seed", "min_delta",
                     "overfit_steps",
                     "rel_delta", "margin", "alert_wait_s", "spike_min_norm", "min_growth_mb", "min_ms",
                     "lr_fraction"), _AT_LEAST_0),
    **dict.fromkeys(("factor", "spike_factor", "ratio", "min_ratio", "max_ratio", "threshold", "layer_threshold",
                     "min_scale", "std_threshold", "high", "low", "span", "retry_backoff", "retry_max_backoff",
                     "close_timeout"), _POSITIVE),
    **dict.fromkeys(("saturation", "saturated_share", "class_fraction", "max_skip_fraction", "min_rising",
                     "giveback", "overfit_drop"), _FRACTION),
    **dict.fromkeys(("min_r2", "floor_fraction"), _UNIT),
    "ema_beta": (0, True, 1, False),
}
#: Rules whose ``threshold`` is a fraction, not a magnitude.
FRACTION_THRESHOLD = frozenset({"dead_units", "memory_pressure", "data_bottleneck"})
#: (smaller, larger) option pairs that must be ordered.
ORDERED = (("min_ratio", "max_ratio"), ("low", "high"), ("retry_backoff", "retry_max_backoff"))


def type_problem(value: Any, annotation: Any) -> str | None:
    """None if ``value`` fits ``annotation`` (unions, ``list[X]``, ``dict[K, V]`` element types
    included; numbers finite, ints within ±2**31), else a message naming the expected type."""
    if isinstance(value, Unresolved):
        return f"cannot resolve {str(value)!r} ({value.error})"
    if annotation is Any:
        return None
    union = typing.get_origin(annotation) in (typing.Union, _UnionType)
    options = typing.get_args(annotation) if union else (annotation,)
    for opt in options:
        if _fits(value, opt):
            return _number_problem(value)
    names = " or ".join(_name(o) for o in options)
    return f"expected {names}, got {show_value(value)}"


def _fits(value: Any, opt: Any) -> bool:
    base = typing.get_origin(opt) or opt
    if opt is type(None) or opt is None:
        return value is None
    if opt is Any:
        return True
    if base is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if base is float:
        return isinstance(value, (int, float))
    if base in (int, str):
        return isinstance(value, base)
    if base is list:
        args = typing.get_args(opt)
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if base is dict:
        args = typing.get_args(opt)
        return isinstance(value, dict) and (not args or all(
            _fits(k, args[0]) and _fits(v, args[1]) for k, v in value.items()))
    if isinstance(base, type) and base.__module__ == "typing":  # TextIO and friends: Python API only
        return True
    return isinstance(base, type) and isinstance(value, base)


def _number_problem(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
        return f"must be at most {INT_LIMIT} in size, got {show_value(value)}"
    return None


def range_problem(key: str, value: Any, default: Any = None, owner: str = "") -> str | None:
    """None if the number ``value`` of option ``key`` is in range, else why not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    rng = RANGES.get(key)
    if key == "threshold" and owner in FRACTION_THRESHOLD:
        rng = _FRACTION
    if rng is None:
        if isinstance(default, (int, float)) and not isinstance(default, bool) and default >= 0 and value < 0:
            return f"must be >= 0, got {value!r}"
        return None
    low, low_in, high, high_in = rng
    if (low is not None and (value < low or (value == low and not low_in))) or \
            (high is not None and (value > high or (value == high and not high_in))):
        return f"must be {_describe(rng)}, got {value!r}"
    return None


def _describe(rng: Range) -> str:
    low, low_in, high, high_in = rng
    if high is None:
        return f"{'>=' if low_in else '>'} {low}"
    return f"in {'[' if low_in else '('}{low}, {high}{']' if high_in else ')'}"


def order_problems(path: str, entry: Mapping[str, Any], defaults: Mapping[str, Any]) -> list[str]:
    """Ordered pairs (``min_ratio < max_ratio``...) of an entry, its defaults filling the gaps."""
    out = []
    for lo, hi in ORDERED:
        if lo in entry or hi in entry:
            a, b = entry.get(lo, defaults.get(lo)), entry.get(hi, defaults.get(hi))
            if _num(a) and _num(b) and not a <= b:
                out.append(f"{path}.{lo}/{hi}: {lo} must not exceed {hi}, got {a!r} > {b!r}")
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def target_problem(path: str, target: Any, base: type | None,
                   resolve: Callable[[str], Any]) -> tuple[type | None, str | None]:
    """(class, None) when ``target`` imports to a subclass of ``base``, else (None, why not).

    Only classes of the right family are accepted: ``builtins:print`` or ``subprocess:Popen``
    are refused before anything is called.
    """
    if not isinstance(target, str) or not target.strip():
        return None, f"{path}._target_: expected 'package.module:Class', got {show_value(target)}"
    try:
        obj = resolve(target)
    except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, ValueError, whatever the import does
        return None, f"{path}._target_: cannot import {target!r}: {type(exc).__name__}: {exc}"
    if not isinstance(obj, type):
        return None, f"{path}._target_: {target!r} is a {type(obj).__name__}, not a class"
    if base is not None and not issubclass(obj, base):
        return None, f"{path}._target_: {target!r} is not a {base.__module__}.{base.__name__} subclass"
    return obj, None


def callable_problem(path: str, value: Any, resolve: Callable[[str], Any]) -> str | None:
    """None if ``value`` is None, a callable, or a dotted path that imports to one."""
    if value is None or callable(value):
        return None
    if not isinstance(value, str):
        return f"{path}: expected a callable or 'package.module:function', got {show_value(value)}"
    try:
        obj = resolve(value)
    except Exception as exc:  # noqa: BLE001
        return f"{path}: cannot import {value!r}: {type(exc).__name__}: {exc}"
    return None if callable(obj) else f"{path}: {value!r} is not callable"


def unresolved_problems(obj: Any, path: str = "diag", depth: int = 0) -> list[str]:
    """Every :class:`Unresolved` value (a failed OmegaConf interpolation) under ``obj``."""
    if isinstance(obj, Unresolved):
        return [f"{path}: cannot resolve {str(obj)!r} ({obj.error})"]
    if depth > 32:
        return []
    if isinstance(obj, Mapping):
        return [p for k, v in obj.items() for p in unresolved_problems(v, f"{path}.{k}", depth + 1)]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in unresolved_problems(v, f"{path}[{i}]", depth + 1)]
    return []


def _name(opt: Any) -> str:
    base = typing.get_origin(opt) or opt
    if opt is type(None):
        return "null"
    args = typing.get_args(opt)
    name = getattr(base, "__name__", str(opt))
    return f"{name}[{', '.join(_name(a) for a in args)}]" if args and base in (list, dict) else name


def show_value(value: Any) -> str:
    """A bounded repr for messages (a 30 MB string must not become a 30 MB error)."""
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({len(text)} characters)"


def budget_problems(value: object) -> list[str]:
    """Problems of ``diag.budget``: ``auto``, ``null``/``false``, or a share in (0, 1]."""
    if value is None or value is False or value == "auto":
        return []
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1:
        return []
    return [f"diag.budget: {value!r} is not 'auto', null (no budget) or a share of the step in (0, 1] (0.09: 9 %)"]

"""Validation of ``log_eval`` values, shared by the live and the disabled session.

A value is kept when it is a real number (``bool``, ``int``, ``float``, NumPy scalar) or a
one-element real tensor/array; NaN and Inf are kept (rules judge them). Anything else (a string,
``None``, a tensor of several elements, a complex number) is skipped and named in one warning per
call, so an odd metric never stops training. Cost: a type check per value; with ``convert`` a
one-element device tensor is read back (one host sync, at evaluation time).
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping

log = logging.getLogger("trackdiag")
EXPECTED = "a real number or a one-element tensor"


def eval_scalars(loss: Any, metrics: Mapping[str, Any], *, convert: bool = True) -> dict[str, float]:
    """``{"loss": loss, **metrics}`` as floats (``loss=None`` means no loss); odd values skipped
    with one warning listing them. Without ``convert`` values are checked but not read (the
    returned floats are then NaN placeholders): the disabled session costs no host sync."""
    items = ([("loss", loss)] if loss is not None else []) + list(metrics.items())
    values: dict[str, float] = {}
    skipped: list[str] = []
    for key, value in items:
        number = _number(value, convert)
        if number is None:
            skipped.append(f"{key}={_describe(value)}")
        else:
            values[str(key)] = number
    if skipped:
        log.warning("trackdiag: log_eval skipped %s: expected %s", ", ".join(skipped), EXPECTED)
    return values


def _number(value: Any, convert: bool) -> float | None:
    """The float of ``value``, or None when it is not a real scalar."""
    if isinstance(value, (bool, int, float)):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range
            return None
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    dtype = str(getattr(value, "dtype", ""))
    if numel is None or not dtype or "complex" in dtype or "str" in dtype or dtype in ("object", "bool_"):
        return None
    try:
        n = numel() if callable(numel) else int(numel)
        if n != 1:
            return None
        if not convert:
            return math.nan
        item = value.detach().item() if hasattr(value, "detach") else value.item()
        return float(item) if isinstance(item, (bool, int, float)) else None
    except (TypeError, ValueError, RuntimeError, OverflowError, AttributeError):
        return None


def _describe(value: Any) -> str:
    """``'high' (str)``, ``None``, ``tensor of 3 elements``: short, never the whole value."""
    shape = getattr(value, "shape", None)
    if shape is not None and not isinstance(value, (bool, int, float)):
        return f"<{type(value).__name__} of shape {tuple(shape)}>"
    text = repr(value)
    return (text if len(text) <= 60 else text[:57] + "...") + ("" if value is None else f" ({type(value).__name__})")

"""Check ``diag.sink.wandb.settings`` against ``wandb.Settings`` before training starts.

W&B's ``Settings`` is a pydantic model that forbids unknown fields: without this check, a
misspelled setting passes validation and the W&B sink then switches itself off at ``wandb.init``
with a ``ValidationError``, after training started. :func:`settings_problems` returns problem lines
(never raises) for :func:`trackdiag.config.load.validate`'s one ``ConfigError``.

Cost: nothing when no settings are given or the sink is ``disabled``; otherwise ``import wandb``
(0.5-3.5 s, once per process; the sink imports it anyway when it starts its run), the field list read
once per process, and one ``wandb.Settings(...)`` construction (~0.2-0.6 ms), plus one per
setting only when that construction fails (to name the bad ones).
"""
from __future__ import annotations

import difflib
import functools
import importlib.util
from typing import Any, Mapping

from trackdiag.config.checks import show_value
from trackdiag.core.errors import TrackdiagError
from trackdiag.sinks.wandb_util import resolve_mode
from trackdiag.util.sanitize import Unresolved


@functools.cache
def settings_fields() -> tuple[str, ...]:
    """The field names ``wandb.Settings`` accepts (imports wandb; read once per process)."""
    import wandb

    return tuple(wandb.Settings.model_fields)


def settings_problems(path: str, settings: Any, mode: Any) -> list[str]:
    """Problems of the W&B sink's ``settings`` mapping at ``path`` (``diag.sink.wandb.settings``).

    Each unknown field is named with its value and the closest valid names (difflib); each value
    ``wandb.Settings`` refuses is named with W&B's reason. ``mode`` is the sink's ``mode`` option
    (None: ``$WANDB_MODE``): a ``disabled`` sink uses no settings and is not checked. When wandb is
    not installed, one line says so. A non-mapping ``settings`` is left to the type check.
    """
    if not isinstance(settings, Mapping) or not settings:
        return []
    try:
        if resolve_mode(mode if isinstance(mode, str) and not isinstance(mode, Unresolved) else None) == "disabled":
            return []
    except TrackdiagError:
        return []  # a bad mode is reported by the mode check
    if importlib.util.find_spec("wandb") is None:
        return [f"{path}: cannot be checked (nor used): wandb is not installed; pip install 'trackdiag[wandb]'"]
    fields = settings_fields()
    problems: list[str] = []
    known: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, Unresolved):
            continue  # reported by the interpolation check
        if key in fields:
            known[str(key)] = value
            continue
        close = difflib.get_close_matches(str(key), fields, n=3, cutoff=0.6)
        hint = f"close matches: {', '.join(close)}" if close else "see wandb.Settings for the accepted names"
        problems.append(f"{path}.{key}: unknown wandb.Settings field (value {show_value(value)}); {hint}")
    if known and (together := _refusal(known)) is not None:
        alone = {key: why for key, value in known.items() if (why := _refusal({key: value})) is not None}
        problems += [f"{path}.{key}: wandb.Settings refuses {show_value(known[key])}: {why}" for key, why in alone.items()]
        if not alone:
            problems.append(f"{path}: wandb.Settings refuses these settings together: {together}")
    return problems


def _refusal(values: Mapping[str, Any]) -> str | None:
    """None if ``wandb.Settings(**values)`` accepts them, else W&B's reason in one line."""
    import wandb

    try:
        wandb.Settings(**values)
    except Exception as exc:  # noqa: BLE001 - pydantic ValidationError, wandb UsageError, ValueError...
        if type(exc).__name__ == "ValidationError" and callable(getattr(exc, "errors", None)):
            return "; ".join(str(e.get("msg", e)) for e in exc.errors())  # type: ignore[attr-defined]
        text = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {text[0] if text else ''}"
    return None

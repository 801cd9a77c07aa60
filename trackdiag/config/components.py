"""Per-component config checks: probe, rule and sink options against their constructors.

:func:`component_problems` checks one ``probes.<name>`` / ``rules.<name>`` / ``sink.<name>`` entry:
its ``_target_`` (an importable class of the right family, nothing else is called), unknown
options, types, known enums, ``loss_fn`` targets, ranges and ordered pairs
(:mod:`trackdiag.config.checks`), the W&B sink's ``settings`` against ``wandb.Settings``
(:mod:`trackdiag.config.wandb_settings`); an enabled built-in component with no static problem is then
built once on trial, so whatever its constructor refuses is reported too. Returns problem lines,
never raises. Cost: one signature read and, for enabled built-ins, one cheap construction.
"""
from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Mapping

from trackdiag.config.checks import (
    callable_problem,
    order_problems,
    range_problem,
    show_value,
    target_problem,
    type_problem,
)
from trackdiag.config.wandb_settings import settings_problems
from trackdiag.core.alert import ACTIONS, SEVERITIES
from trackdiag.core.errors import ConfigError
from trackdiag.core.registry import resolve as resolve_target
from trackdiag.sinks.wandb_util import MODES, SEVERITY_RANK
from trackdiag.util.sanitize import Unresolved

#: Options whose accepted values are known up front (checked even for sinks not in use).
ENUMS: dict[tuple[str, str, str], tuple[Any, ...]] = {
    ("sink", "wandb", "mode"): (*MODES, "dryrun", None),
    ("sink", "wandb", "notify"): (*SEVERITY_RANK, None),
    ("sink", "mlflow", "delivery"): ("process", "thread"),
}


def component_problems(path: str, family: str, registry: dict[str, type], name: str, entry: Any,
                       active: bool) -> list[str]:
    """Problems of one component entry at ``path`` (``diag.rules.loss_spike``); ``active``: it will be built."""
    if entry is None:
        entry = {}
    if not isinstance(entry, Mapping):
        return [f"{path}: expected a mapping of options, got {show_value(entry)}"]
    if "_target_" in entry:
        cls, problem = target_problem(path, entry["_target_"], _family_base(family), resolve_target)
        if cls is None:
            return [problem or f"{path}._target_: invalid"]
    elif name in registry:
        cls = registry[name]
    else:
        kind = family[:-1] if family != "sink" else "sink"
        return [f"{path}: unknown {kind} {name!r}; accepted: {', '.join(registry)}"]
    try:
        params, defaults = constructor_params(cls), constructor_defaults(cls)
    except Exception as exc:  # noqa: BLE001 - a user class whose signature cannot be read
        return [f"{path}: cannot read the options of {cls.__name__}: {type(exc).__name__}: {exc}"]
    problems = []
    for key, value in entry.items():
        if key == "_target_" or isinstance(value, Unresolved):
            continue
        if key not in params:
            problems.append(f"{path}.{key}: unknown option; accepted: {', '.join(params)}")
        elif (msg := type_problem(value, params[key])) is not None:
            problems.append(f"{path}.{key}: {msg}")
        elif key == "action" and value not in ACTIONS:
            problems.append(f"{path}.action: {show_value(value)} is not one of {', '.join(ACTIONS)}")
        elif key == "severity" and value is not None and value not in SEVERITIES:
            problems.append(f"{path}.severity: {show_value(value)} is not one of {', '.join(SEVERITIES)}")
        elif (choices := ENUMS.get((family, name, key))) is not None and \
                (value.lower() if isinstance(value, str) else value) not in choices:
            accepted = ", ".join("null" if c is None else str(c) for c in choices)
            problems.append(f"{path}.{key}: {show_value(value)} is not one of {accepted}")
        elif key == "loss_fn" and (msg := callable_problem(f"{path}.{key}", value, resolve_target)) is not None:
            problems.append(msg)
        elif (msg := range_problem(key, value, defaults.get(key), name)) is not None:
            problems.append(f"{path}.{key}: {msg}")
    problems += order_problems(path, entry, defaults)
    if family == "sink" and name == "wandb" and active and "_target_" not in entry:
        problems += settings_problems(f"{path}.settings", entry.get("settings"), entry.get("mode"))
    if not problems and active and "_target_" not in entry:
        problems += _trial_build(path, cls, entry)
    return problems


def _trial_build(path: str, cls: type, entry: Mapping[str, Any]) -> list[str]:
    """Build a built-in component once with its options: what its constructor refuses is a problem."""
    try:
        cls(**{k: v for k, v in entry.items() if k != "_target_"})
    except ConfigError as exc:
        return list(exc.problems)
    except Exception as exc:  # noqa: BLE001 - e.g. TrackdiagError for a missing optional package
        return [f"{path}: {type(exc).__name__}: {exc}"]
    return []


def _family_base(family: str) -> type:
    if family == "probes":
        from trackdiag.probes.base import Probe

        return Probe
    if family == "rules":
        from trackdiag.rules.base import Rule

        return Rule
    from trackdiag.sinks.base import Sink

    return Sink


def constructor_params(cls: type) -> dict[str, Any]:
    """Keyword options of ``cls.__init__`` with their annotations, following ``**kw`` up the MRO."""
    return dict(_signature(cls)[0])


def constructor_defaults(cls: type) -> dict[str, Any]:
    """Default values of the keyword options :func:`constructor_params` lists."""
    return dict(_signature(cls)[1])


@functools.lru_cache(maxsize=512)
def _signature(cls: type) -> tuple[dict[str, Any], dict[str, Any]]:
    """(options with annotations, defaults) of ``cls``, read once per class and process: a session checks
    every component's options (~70 classes), and reading signatures and type hints cost ~75 ms a session."""
    params: dict[str, Any] = {}
    defaults: dict[str, Any] = {}
    more = True
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        signature = inspect.signature(init).parameters.values()
        for p in signature:
            if p.default is not p.empty:
                defaults.setdefault(p.name, p.default)
        if not more:
            continue
        try:
            hints = typing.get_type_hints(init)
        except Exception:  # noqa: BLE001 - unresolvable forward references: options stay untyped
            hints = {}
        more = False
        for p in signature:
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.name != "self" and p.kind is not p.VAR_POSITIONAL:
                params.setdefault(p.name, hints.get(p.name, Any))
    return params, defaults

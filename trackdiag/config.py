"""Load presets, merge overrides, and validate a diagnostics config in one pass.

Validation collects every problem (key path, bad value, accepted values) and raises one
:class:`ConfigError` before training starts. Probe, rule and sink options are checked against
the constructor signatures of the classes they configure, so a new component needs no schema edit.
"""
from __future__ import annotations

import copy
import inspect
import typing
from importlib import resources
from typing import Any, Mapping

import yaml

from trackdiag.alert import ACTIONS, SEVERITIES
from trackdiag.errors import ConfigError
from trackdiag.registry import PROBES, RULES, SINKS, lookup

_TOP: dict[str, Any] = {
    "level": str, "enabled": bool, "every": int, "max_layer_metrics": int, "history": int,
    "anomaly_window": int, "max_alerts_per_rule": int, "output_dir": str | None, "run_name": str | None, "sinks": list,
    "probes": dict, "rules": dict, "sink": dict,
}
_POSITIVE = ("every", "max_layer_metrics", "history", "max_alerts_per_rule")


def presets() -> list[str]:
    """Names of the packaged presets."""
    files = resources.files("trackdiag.conf").joinpath("diag").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


def load_preset(level: str) -> dict[str, Any]:
    """The packaged preset ``level`` as a plain dict."""
    if level not in presets():
        raise ConfigError([f"diag.level: unknown preset {level!r}; accepted: {', '.join(presets())}"])
    data = _read("diag", f"{level}.yaml")
    out: dict[str, Any] = {}
    for entry in data.pop("defaults", None) or ["_self_"]:  # emulate Hydra's defaults list
        if entry == "_self_":
            out = merge(out, data)
        else:
            (group, option), = entry.items()
            text = _text("diag", group, f"{option}.yaml")
            if not text.lstrip().startswith("# @package _global_"):  # Hydra-level configs (callbacks) hold no diag keys
                out = merge(out, yaml.safe_load(text) or {})
    return out


def _text(*parts: str) -> str:
    return resources.files("trackdiag.conf").joinpath(*parts).read_text(encoding="utf-8")


def _read(*parts: str) -> dict[str, Any]:
    return yaml.safe_load(_text(*parts)) or {}


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``over`` onto ``base`` (dicts merge, everything else replaces)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def to_plain(cfg: Any) -> Any:
    """An OmegaConf node (or anything) as plain Python containers, interpolations resolved."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:
        pass
    return cfg


def resolve(cfg: Any) -> dict[str, Any]:
    """A user's ``diag`` config (dict or DictConfig) merged onto the preset its ``level`` names, validated."""
    cfg = to_plain(cfg)
    if isinstance(cfg, str):
        raise ConfigError([
            f"diag: got the string {cfg!r} instead of a config. Hydra did not find trackdiag's 'diag' config group, "
            f"so '+diag={cfg}' set a plain value. Is trackdiag installed (pip install trackdiag) in the Python "
            f"that runs this app? Accepted presets: {', '.join(presets())}"])
    if not isinstance(cfg, Mapping):
        raise ConfigError([f"diag: expected a mapping, got {type(cfg).__name__}"])
    level = cfg.get("level", "advanced")
    if not isinstance(level, str) or level not in presets():
        raise ConfigError([f"diag.level: unknown preset {level!r}; accepted: {', '.join(presets())}"])
    merged = merge(load_preset(level), cfg)
    validate(merged)
    return merged


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise one :class:`ConfigError` listing every problem in ``cfg``."""
    problems: list[str] = []
    for key, value in cfg.items():
        if key not in _TOP:
            problems.append(f"diag.{key}: unknown key; accepted: {', '.join(_TOP)}")
        elif (msg := _type_problem(value, _TOP[key])) is not None:
            problems.append(f"diag.{key}: {msg}")
        elif key in _POSITIVE and value < 1:
            problems.append(f"diag.{key}: must be >= 1, got {value!r}")
    if cfg.get("level") not in presets():
        problems.append(f"diag.level: unknown preset {cfg.get('level')!r}; accepted: {', '.join(presets())}")
    for name in cfg.get("sinks") or [] if isinstance(cfg.get("sinks"), list) else []:
        if name not in SINKS:
            problems.append(f"diag.sinks: unknown sink {name!r}; accepted: {', '.join(SINKS)}")
    for family, registry in (("probes", PROBES), ("rules", RULES), ("sink", SINKS)):
        section = cfg.get(family) or {}
        if isinstance(section, Mapping):
            for name, entry in section.items():
                problems += _component_problems(f"diag.{family}.{name}", family, registry, name, entry)
    if problems:
        raise ConfigError(problems)


def _component_problems(path: str, family: str, registry: dict[str, str], name: str, entry: Any) -> list[str]:
    if entry is None:
        entry = {}
    if not isinstance(entry, Mapping):
        return [f"{path}: expected a mapping of options, got {entry!r}"]
    if name not in registry and not entry.get("_target_"):
        return [f"{path}: unknown {family[:-1] if family != 'sink' else 'sink'} {name!r}; accepted: {', '.join(registry)}"]
    try:
        cls = lookup(registry, name, dict(entry))
    except (ImportError, AttributeError) as exc:
        return [f"{path}._target_: cannot import {entry.get('_target_')!r}: {exc}"]
    params = constructor_params(cls)
    problems = []
    for key, value in entry.items():
        if key == "_target_":
            continue
        if key not in params:
            problems.append(f"{path}.{key}: unknown option; accepted: {', '.join(params)}")
        elif (msg := _type_problem(value, params[key])) is not None:
            problems.append(f"{path}.{key}: {msg}")
        elif key == "action" and value not in ACTIONS:
            problems.append(f"{path}.action: {value!r} is not one of {', '.join(ACTIONS)}")
        elif key == "severity" and value is not None and value not in SEVERITIES:
            problems.append(f"{path}.severity: {value!r} is not one of {', '.join(SEVERITIES)}")
        elif key in ("every", "cooldown", "warmup", "patience") and value is not None and value < (1 if key == "every" else 0):
            problems.append(f"{path}.{key}: must be {'>= 1' if key == 'every' else '>= 0'}, got {value!r}")
    return problems


def constructor_params(cls: type) -> dict[str, Any]:
    """Keyword options of ``cls.__init__`` with their annotations, following ``**kw`` up the MRO."""
    params: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        hints = typing.get_type_hints(init)
        more = False
        for p in inspect.signature(init).parameters.values():
            if p.kind is p.VAR_KEYWORD:
                more = True
            elif p.name != "self" and p.kind is not p.VAR_POSITIONAL:
                params.setdefault(p.name, hints.get(p.name, Any))
        if not more:
            break
    return params


def _type_problem(value: Any, annotation: Any) -> str | None:
    """``None`` if ``value`` fits ``annotation``, else a message naming the expected type."""
    if annotation is Any:
        return None
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, _UnionType) else (annotation,)
    for opt in options:
        base = typing.get_origin(opt) or opt
        if opt is type(None) and value is None:
            return None
        if base is bool and isinstance(value, bool):
            return None
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None
        if base in (int, str, list, dict) and isinstance(value, base) and not isinstance(value, bool):
            return None
    names = " or ".join(getattr(typing.get_origin(o) or o, "__name__", str(o)) for o in options)
    return f"expected {names}, got {value!r}"


_UnionType = type(int | None)

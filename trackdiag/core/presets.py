"""The packaged presets (``trackdiag/conf/diag/*.yaml``) as plain dicts, Hydra's defaults list emulated.

Reading only: validation against the components lives in :mod:`trackdiag.config.load`. Parsed YAML
is cached per process; callers get fresh copies.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

import yaml

from trackdiag.core.errors import ConfigError


def presets() -> list[str]:
    """Names of the packaged presets."""
    files = resources.files("trackdiag.conf").joinpath("diag").iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml"))


def load_preset(level: str) -> dict[str, Any]:
    """The packaged preset ``level`` as a plain dict (a fresh copy: callers may change it)."""
    if level not in presets():
        raise ConfigError([f"diag.level: unknown preset {level!r}; accepted: {', '.join(presets())}"])
    return copy.deepcopy(_preset(level))


@lru_cache(maxsize=16)
def _preset(level: str) -> dict[str, Any]:
    """The parsed preset (cached: YAML parsing dominated validation's cost); never hand it out."""
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


@lru_cache(maxsize=64)
def _text(*parts: str) -> str:
    """A packaged YAML file's text (cached: validation may run many times in a process)."""
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

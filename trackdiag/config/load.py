"""Load presets, merge overrides, and validate a diagnostics config in one pass.

Validation collects every problem (key path, bad value, accepted values) and raises one
:class:`ConfigError` before training starts. Probe, rule and sink options are checked against
the constructor signatures of the classes they configure, so a new component needs no schema edit;
value ranges live in :mod:`trackdiag.config.checks`.
"""
from __future__ import annotations

from typing import Any, Mapping

from trackdiag.config.checks import budget_problems, range_problem, show_value, type_problem, unresolved_problems
from trackdiag.config.components import component_problems, constructor_defaults, constructor_params
from trackdiag.core.errors import ConfigError
from trackdiag.core.presets import load_preset, merge, presets  # noqa: F401 (part of this module's API)
from trackdiag.core.registry import PROBES, RULES, SINKS
from trackdiag.util.redact import pattern_problems
from trackdiag.util.sanitize import Unresolved, to_plain_tolerant

__all__ = ["presets", "load_preset", "merge", "to_plain", "resolve", "validate", "constructor_params",
           "constructor_defaults"]

_TOP: dict[str, Any] = {
    "level": str, "enabled": bool, "every": int, "max_layer_metrics": int, "history": int,
    "anomaly_window": int, "max_alerts_per_rule": int, "output_dir": str | None, "run_name": str | None,
    "sinks": list[str], "probes": dict, "rules": dict, "sink": dict, "redact": dict | None,
    "objective": str | dict | None, "budget": Any, "sweep": dict | None,
}
#: what a component's loss is for (see README, "Objectives"): ``minimize`` (the default), ``adversarial``
#: (a GAN's generator/discriminator pair), ``rl`` (a policy-gradient / actor-critic objective)
OBJECTIVES = ("minimize", "adversarial", "rl", "auto")
#: The ``redact`` section (see :mod:`trackdiag.util.redact`).
_REDACT: dict[str, Any] = {"enabled": bool, "keys": list[str] | None, "patterns": list[str] | None}
#: The ``sweep`` section: an Optuna trial stopped on alerts (see :mod:`trackdiag.integrations.optuna_sweep`).
_SWEEP: dict[str, Any] = {"stop_on": list[str] | None, "on_stop": str, "planned_steps": int | None}
SWEEP_ON_STOP = ("prune", "fail")


def to_plain(cfg: Any) -> Any:
    """An OmegaConf node (or anything) as plain Python containers, interpolations resolved.

    Never raises for a bad interpolation: a value that cannot be resolved is kept as its text in
    an :class:`~trackdiag.util.sanitize.Unresolved` string (validation reports it for the diag config;
    hyperparameters keep it as text with a note).
    """
    return to_plain_tolerant(cfg)


def resolve(cfg: Any) -> dict[str, Any]:
    """A user's ``diag`` config (dict or DictConfig) merged onto the preset its ``level`` names, validated."""
    cfg = to_plain(cfg)
    if isinstance(cfg, str) and not isinstance(cfg, Unresolved):
        raise ConfigError([
            f"diag: got the string {cfg!r} instead of a config. Hydra did not find trackdiag's 'diag' config group, "
            f"so '+diag={cfg}' set a plain value. Is trackdiag installed (pip install trackdiag) in the Python "
            f"that runs this app? Accepted presets: {', '.join(presets())}"])
    if not isinstance(cfg, Mapping):
        raise ConfigError(unresolved_problems(cfg) or [f"diag: expected a mapping, got {type(cfg).__name__}"])
    level = cfg.get("level", "advanced")
    if not isinstance(level, str) or isinstance(level, Unresolved) or level not in presets():
        bad = f"diag.level: unknown preset {show_value(level)}; accepted: {', '.join(presets())}"
        raise ConfigError(list(dict.fromkeys([*unresolved_problems(cfg), bad])))
    merged = merge(load_preset(level), cfg)
    validate(merged)
    return merged


def validate(cfg: Mapping[str, Any]) -> None:
    """Raise one :class:`ConfigError` listing every problem in ``cfg``: unknown keys and options,
    types (list elements too), non-finite or out-of-range numbers, unimportable or wrong-family
    ``_target_`` classes, failed interpolations, bad ``redact`` regexes, and whatever the enabled
    built-in components' constructors refuse (they are built once, on trial, with their options)."""
    problems: list[str] = unresolved_problems(cfg)
    for key, value in cfg.items():
        if isinstance(value, Unresolved):
            continue
        if key not in _TOP:
            problems.append(f"diag.{key}: unknown key; accepted: {', '.join(_TOP)}")
        elif (msg := type_problem(value, _TOP[key]) or range_problem(str(key), value)) is not None:
            problems.append(f"diag.{key}: {msg}")
    if not isinstance(cfg.get("level"), Unresolved) and cfg.get("level") not in presets():
        problems.append(f"diag.level: unknown preset {show_value(cfg.get('level'))}; accepted: {', '.join(presets())}")
    sinks = cfg.get("sinks") if isinstance(cfg.get("sinks"), list) else []
    sink_cfg = cfg.get("sink") if isinstance(cfg.get("sink"), Mapping) else {}
    active_sinks = ["local"]
    for name in sinks:
        if not isinstance(name, str) or isinstance(name, Unresolved):
            continue  # reported by the type check
        if name not in SINKS and not (isinstance(sink_cfg.get(name), Mapping) and sink_cfg[name].get("_target_")):
            problems.append(f"diag.sinks: unknown sink {name!r}; accepted: {', '.join(SINKS)}")
        else:
            active_sinks.append(name)
    problems += _redact_problems(cfg.get("redact"))
    problems += objective_problems(cfg.get("objective"))
    problems += sweep_problems(cfg.get("sweep"))
    if not isinstance(cfg.get("budget"), Unresolved):
        problems += budget_problems(cfg.get("budget"))
    for family, registry in (("probes", PROBES), ("rules", RULES), ("sink", SINKS)):
        section = cfg.get(family) or {}
        if not isinstance(section, Mapping):
            continue
        for name, entry in section.items():
            active = name in active_sinks if family == "sink" else _enabled(entry)
            problems += component_problems(f"diag.{family}.{name}", family, registry, str(name), entry, active)
    for name in dict.fromkeys(active_sinks):
        if name not in sink_cfg and name in SINKS:  # a sink with no options still gets its constructor's checks
            problems += component_problems(f"diag.sink.{name}", "sink", SINKS, name, {}, True)
    if problems:
        raise ConfigError(list(dict.fromkeys(problems)))


def objective_problems(value: Any) -> list[str]:
    """Problems of ``diag.objective``: one of ``OBJECTIVES``, or a mapping component -> one of them."""
    if value is None or isinstance(value, Unresolved):
        return []
    pairs = value.items() if isinstance(value, Mapping) else [(None, value)]
    out = []
    for name, v in pairs:
        if not isinstance(v, str) or v not in OBJECTIVES:
            path = "diag.objective" + (f".{name}" if name is not None else "")
            out.append(f"{path}: {show_value(v)} is not one of {', '.join(OBJECTIVES)}")
    return out


def sweep_problems(section: Any) -> list[str]:
    """Problems of ``diag.sweep``: unknown options, types, ``on_stop`` not prune/fail, an empty
    ``stop_on`` entry, ``planned_steps`` < 1."""
    if not isinstance(section, Mapping):
        return []  # absent: off; wrong type: reported by the type check
    out = [f"diag.sweep.{k}: unknown option; accepted: {', '.join(_SWEEP)}" for k in section if k not in _SWEEP]
    out += [f"diag.sweep.{k}: {msg}" for k, t in _SWEEP.items()
            if k in section and (msg := type_problem(section[k], t)) is not None]
    on_stop = section.get("on_stop", "prune")
    if isinstance(on_stop, str) and on_stop not in SWEEP_ON_STOP:
        out.append(f"diag.sweep.on_stop: {show_value(on_stop)} is not one of {', '.join(SWEEP_ON_STOP)}")
    stop_on = section.get("stop_on")
    if isinstance(stop_on, list) and any(isinstance(s, str) and not s.strip() for s in stop_on):
        out.append(f"diag.sweep.stop_on: {show_value(stop_on)} has an empty entry; give severities "
                   "(info, warning, critical) and/or alert kinds")
    steps = section.get("planned_steps")
    if isinstance(steps, int) and not isinstance(steps, bool) and steps < 1:
        out.append(f"diag.sweep.planned_steps: {steps} is not a step count >= 1 (or null)")
    return out


def _enabled(entry: Any) -> bool:
    return not isinstance(entry, Mapping) or entry.get("enabled", True) is not False


def _redact_problems(section: Any) -> list[str]:
    if section is None or isinstance(section, Unresolved) or not isinstance(section, Mapping):
        return []  # absent: defaults; wrong type: reported by the type check
    problems = [f"diag.redact.{k}: unknown option; accepted: {', '.join(_REDACT)}" for k in section if k not in _REDACT]
    problems += [f"diag.redact.{k}: {msg}" for k, t in _REDACT.items()
                 if k in section and (msg := type_problem(section[k], t)) is not None]
    for k in ("keys", "patterns"):
        if isinstance(section.get(k), list):
            problems += pattern_problems(f"diag.redact.{k}", section[k])
    return problems

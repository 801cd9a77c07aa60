"""Issue 15, item 5: property-based fuzzing of the diagnostics config (hypothesis, derandomized).

1. Invalid configs (1-4 mutations, each invalid whatever else the config holds: NaN/inf, huge ints,
   wrong types and element types, negative windows and factors, bad enums, unknown keys, targets
   that are not classes of the right family, unimportable ``loss_fn``, unresolvable OmegaConf
   interpolations, bad ``redact`` regexes), as plain dicts or DictConfigs: every one raises exactly
   ``ConfigError`` naming each mutated component, before anything is hooked.
2. Random values for random options, valid or not: a config that validation accepts must run
   (12 steps with a NaN among them, evaluations, close) without an exception.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from trackdiag import ConfigError, Diagnostics  # noqa: E402
from trackdiag.config.load import constructor_params, load_preset  # noqa: E402
from trackdiag.core.registry import PROBES, RULES  # noqa: E402

UNSET = "${oc.env:TRACKDIAG_FUZZ_NEVER_SET}"
# (path, value) pairs, each invalid on its own
TOP_INVALID = [
    (("every",), 0), (("every",), -3), (("every",), 2.5), (("every",), math.nan), (("history",), 10**30),
    (("history",), 0), (("max_layer_metrics",), "many"), (("anomaly_window",), -1), (("max_alerts_per_rule",), True),
    (("sinks",), [["local"]]), (("sinks",), ["nosuchsink"]), (("sinks",), "local"), (("sinks",), [None]),
    (("bogus_key",), 1), (("probes",), "all"), (("rules",), [1]), (("run_name",), 5), (("output_dir",), ["x"]),
    (("enabled",), "yes"), (("every",), "${missing_key}"), (("run_name",), UNSET), (("redact",), "yes"),
    (("redact", "keys"), ["("]), (("redact", "patterns"), [".*"]), (("redact", "bogus"), 1), (("redact", "keys"), [3]),
    (("sink", "wandb", "mode"), "bogus"), (("sink", "wandb", "notify"), "loud"), (("sink", "wandb", "tags"), [1]),
    (("sink", "mlflow", "delivery"), "pigeon"), (("sink", "mlflow", "retry_backoff"), -1.0),
    (("sink", "mlflow", "close_timeout"), math.inf), (("sink", "mlflow", "tags"), {"a": [1]}),
    (("sink", "nosuch", "x"), 1), (("sink", "local", "_target_"), "builtins:print"),
    (("probes", "nan_replay", "ring"), -1), (("probes", "nan_replay", "ring"), 0), (("probes", "nan_replay", "mode"), 3),
    (("probes", "nan_replay", "loss_fn"), "nosuch_module_xyz:loss"), (("probes", "nan_replay", "loss_fn"), "math:pi"),
    (("rules", "preflight", "loss_fn"), 7), (("rules", "loss_divergence", "window"), 0),
    (("rules", "loss_divergence", "factor"), -2.0), (("rules", "loss_spike", "ema_beta"), 1.5),
    (("rules", "grad_flow", "min_ratio"), 1e5), (("rules", "grad_explosion", "threshold"), math.nan),
    (("rules", "dead_units", "threshold"), 1.5), (("rules", "plateau", "action"), "explode"),
    (("rules", "plateau", "severity"), "loud"), (("rules", "nosuchrule", "x"), 1), (("probes", "nosuchprobe"), {}),
    (("probes", "loss", "_target_"), "builtins:print"), (("probes", "loss", "_target_"), "subprocess:Popen"),
    (("probes", "loss", "_target_"), "trackdiag.rules.loss:LossSpikeRule"), (("probes", "loss", "_target_"), 5),
    (("probes", "loss", "_target_"), "no_such_pkg_zz.mod:Cls"), (("rules", "loss_spike", "_target_"), "os:system"),
    (("probes", "grads"), "on"), (("probes", "grads", "per_layer"), "yes"), (("probes", "grads", "unknown_opt"), 1),
    (("rules", "stale_params", "patience"), -5), (("rules", "loss_spike", "cooldown"), -1),
    (("probes", "histograms", "bins"), 0), (("probes", "landscape", "span"), -1.0),
]
_NUMERIC_BAD = [math.nan, math.inf, -math.inf, 10**30, "ten", [1], {"a": 1}]


def _numeric_options() -> list[tuple[str, str, str]]:
    """(family, component, option) for every numeric option of every built-in probe and rule."""
    out = []
    for family, registry in (("probes", PROBES), ("rules", RULES)):
        for name in registry:
            for opt, ann in constructor_params(registry[name]).items():
                if ann in (int, float, int | None, float | None):
                    out.append((family, name, opt))
    return sorted(out)


NUMERIC = _numeric_options()
mutation = st.one_of(
    st.sampled_from(TOP_INVALID),
    st.tuples(st.sampled_from(NUMERIC), st.sampled_from(_NUMERIC_BAD)).map(lambda t: (t[0], t[1])),
)


def _apply(cfg: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = cfg
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def _get(cfg: dict[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = cfg
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _component(path: tuple[str, ...]) -> str:
    """The part of a path a problem line must name (``diag.rules.loss_spike``, ``diag.every``...)."""
    if path[0] in ("probes", "rules", "sink") and len(path) > 1:
        return "diag." + ".".join(path[:2])
    return "diag." + path[0]


def _model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.05)


def _hooked(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    return bool(opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks
                or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(level=st.sampled_from(["basic", "advanced", "extreme"]), muts=st.lists(mutation, min_size=1, max_size=4),
       as_omegaconf=st.booleans())
def test_every_invalid_config_raises_one_config_error(level: str, muts: list[tuple[tuple[str, ...], Any]],
                                                      as_omegaconf: bool, tmp_path: Path) -> None:
    cfg: dict[str, Any] = {"level": level, "sinks": ["local"], "output_dir": str(tmp_path / "never")}
    for path, value in muts:
        _apply(cfg, path, value)
    node: Any = cfg
    if as_omegaconf or any(isinstance(v, str) and "${" in v for _, v in muts):  # interpolations need OmegaConf
        try:
            node = OmegaConf.create(cfg)
        except Exception:  # noqa: BLE001 - OmegaConf refuses some values (10**30): the plain dict then
            node = cfg
    model, opt = _model_opt()
    with pytest.raises(ConfigError) as info:
        Diagnostics.from_config(node, model=model, optimizer=opt)
    text = "\n".join(info.value.problems)
    for path, value in muts:
        if _get(cfg, path) is not value:
            continue  # overwritten by a later mutation
        assert _component(path) in text or (path[0] == "sinks" and "diag.sinks" in text), (path, text)
    assert not _hooked(model, opt) and not (tmp_path / "never").exists()


# --------------------------------------------------------------------------- accepted => runs
EDGE = [1, 2, 3, 0.5, 0.9, 0.01, 1e-9, 5, 20, 0, 1.0, 10**6, -1]  # mostly valid: edges and a few out of range


@settings(max_examples=80, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@example(level="advanced", every=1, picks=[(("rules", "loss_divergence", "window"), 0)])  # crashed in step()
@example(level="advanced", every=1, picks=[(("probes", "nan_replay", "ring"), -1)])  # crashed in step()
@example(level="advanced", every=2, picks=[(("rules", "memory_leak", "window"), 0), (("probes", "activations", "window"), 0)])
@given(level=st.sampled_from(["basic", "advanced"]), every=st.integers(1, 4),
       picks=st.lists(st.tuples(st.sampled_from(NUMERIC), st.sampled_from(EDGE)), max_size=4))
def test_an_accepted_config_runs(level: str, every: int, picks: list[tuple[tuple[str, str, str], Any]],
                                 tmp_path: Path) -> None:
    cfg: dict[str, Any] = {"level": level, "every": every, "sinks": ["local"], "output_dir": str(tmp_path / "run"),
                           "probes": {"report": {"enabled": False}, "landscape": {"enabled": False}}}
    for (family, name, opt), value in picks:
        if (family, name) != ("probes", "landscape") and not (family == "probes" and name == "report"):
            _apply(cfg, (family, name, opt), value)
    model, opt = _model_opt()
    try:
        diag = Diagnostics.from_config(cfg, model=model, optimizer=opt)
    except ConfigError:
        event("refused")
        return
    event(f"accepted with {len(picks)} picked value(s)")
    gen = torch.Generator().manual_seed(0)
    with diag:
        for step in range(12):
            x = torch.randn(8, 4, generator=gen)
            if step == 5:
                x[0, 0] = math.nan
            loss = torch.nn.functional.cross_entropy(model(x), torch.randint(0, 3, (8,), generator=gen))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            diag.step(loss, outputs=None, batch=(x, None))
            if step % 4 == 3:
                diag.log_eval(loss=float(loss))
    assert (tmp_path / "run" / "summary.json").is_file()
    assert diag.summary()["disabled_probes"] == {}  # no probe failed on an accepted value either


def test_the_presets_themselves_stay_valid() -> None:
    for level in ("basic", "advanced", "extreme"):
        assert load_preset(level)["level"] == level

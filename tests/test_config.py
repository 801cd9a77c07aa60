"""Config validation: one ConfigError listing every problem, before anything is hooked."""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from trackdiag import ConfigError, Diagnostics, DisabledDiagnostics
from trackdiag.config.load import load_preset, presets, resolve


def _model_opt():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _no_hooks(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Nothing of trackdiag on the model, the optimizer, or torch's global hook tables."""
    import torch.optim.optimizer as optim_mod
    from torch.nn.modules import module as module_mod

    mods = list(model.modules())
    return (not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
            and not optim_mod._global_optimizer_pre_hooks and not optim_mod._global_optimizer_post_hooks
            and not module_mod._global_forward_hooks and not module_mod._global_forward_pre_hooks
            and all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in mods)
            and all(not p._backward_hooks for p in model.parameters()))


def test_presets_are_packaged_and_valid() -> None:
    assert {"basic", "advanced", "extreme"} <= set(presets())
    for level in presets():
        cfg = resolve({"level": level})
        assert cfg["level"] == level and cfg["every"] >= 1
    ext, adv, bas = (load_preset(level) for level in ("extreme", "advanced", "basic"))
    assert ext["every"] <= adv["every"] < bas["every"]
    for probe in ("params", "updates", "activations", "histograms"):  # extreme: each probe at a finer cadence
        assert ext["probes"][probe]["every"] < adv["probes"][probe]["every"], probe


def test_every_problem_listed_in_one_error() -> None:
    bad = {"level": "advanced", "every": 0, "bogus": 1, "sinks": ["local", "nosuchsink"],
           "probes": {"nope": {}, "grads": {"per_layer": "yes"}},
           "rules": {"grad_explosion": {"treshold": 3, "action": "explode"}, "loss_spike": {"factor": "ten"}}}
    with pytest.raises(ConfigError) as info:
        resolve(bad)
    text = str(info.value)
    for needle in ("diag.every", "diag.bogus", "nosuchsink", "diag.probes.nope", "diag.probes.grads.per_layer",
                   "diag.rules.grad_explosion.treshold", "explode", "diag.rules.loss_spike.factor"):
        assert needle in text, needle
    assert len(info.value.problems) == 8
    assert "accepted: threshold" in text  # the valid options are named


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'nosuch'.*advanced"):
        resolve({"level": "nosuch"})
    model, opt = _model_opt()
    with pytest.raises(ConfigError, match="nosuch"):
        Diagnostics(model, opt, level="nosuch")
    assert _no_hooks(model, opt)  # raised before anything was hooked


def test_silent_hydra_trap_string_instead_of_config() -> None:
    model, opt = _model_opt()
    with pytest.raises(ConfigError, match="string 'advanced'.*installed"):
        Diagnostics.from_config("advanced", model=model, optimizer=opt)


def test_from_config_without_diag_is_a_disabled_no_op_session() -> None:
    model, opt = _model_opt()
    cfg = OmegaConf.create({"lr": 0.1})
    for node in (cfg.get("diag"), OmegaConf.create({"enabled": False, "level": "basic"})):
        diag = Diagnostics.from_config(node, model=model, optimizer=opt, hparams=cfg)
        assert isinstance(diag, DisabledDiagnostics) and not diag.enabled
        with diag:
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            opt.step()
            assert diag.step(loss, outputs=None, batch=None) is False
            diag.log_eval(loss=1.0)
        assert diag.alerts == [] and diag.summary()["enabled"] is False
        assert _no_hooks(model, opt)


def test_from_config_dictconfig_with_overrides(tmp_path) -> None:
    model, opt = _model_opt()
    node = OmegaConf.create({"level": "basic", "every": 7, "sinks": ["local"], "output_dir": str(tmp_path),
                             "rules": {"grad_explosion": {"threshold": 50.0}}})
    diag = Diagnostics.from_config(node, model=model, optimizer=opt, hparams=OmegaConf.create({"a": {"b": 1}}))
    assert diag.enabled and diag.every == 7
    rule = next(r for r in diag.rules if r.kind == "grad_explosion")
    assert rule.threshold == 50.0
    assert not _no_hooks(model, opt)  # the enabled session follows the optimizer and the gradients...
    diag.close()
    assert _no_hooks(model, opt)  # ...and close() removes every hook

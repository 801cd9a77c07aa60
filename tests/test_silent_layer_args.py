"""Layer arguments that do not mean what they were written for (the ``layer_args`` probe): in TensorFlow's convention
(``tf_convention``: ``nn.Dropout(0.9)`` written for ``keep_prob=0.9`` drops 90 % of the units,
``nn.BatchNorm1d(..., momentum=0.99)`` written for Keras' ``momentum=0.99`` makes the running statistics the last
batch's), and ``nn.LeakyReLU(True)`` written as ``nn.ReLU(True)`` is (``linear_activation``: a slope of 1, the identity).
Nothing crashes and the model learns; the previous build said nothing."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from _harness import local_session
from trackdiag.core.errors import ConfigError

PRESETS = ("basic", "advanced", "extreme")


def mlp(dropout: nn.Module | None = None, norm: nn.Module | None = None, act: nn.Module | None = None) -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), norm or nn.BatchNorm1d(32), act or nn.ReLU(), dropout or nn.Dropout(0.2),
                         nn.Linear(32, 3))


def train(tmp_path: Path, model: nn.Module, level: str = "advanced", steps: int = 40, **overrides: Any) -> Any:
    """A classifier on a rule of its inputs, the README's loop; the finished session."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(512, 16)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    with local_session(model, opt, tmp_path / level, level, **overrides) as diag:
        for _ in range(steps):
            idx = torch.randint(0, 512, (32,))
            out = model(x[idx])
            loss = nn.functional.cross_entropy(out, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            diag.step(loss, outputs=out)
    return diag


def found(diag: Any) -> list[tuple[str, int, str, str]]:
    return [(a.kind, a.step, a.severity, a.where) for a in diag.alerts if a.kind in ("tf_convention", "linear_activation")]


def table(tmp_path: Path, level: str, what: str) -> dict[str, float]:
    from trackdiag.core.record import read_records

    return {k: v for r in read_records(tmp_path / level) for k, v in r.tables.get(f"diag/model/{what}", {}).items()}


@pytest.mark.parametrize("level", PRESETS)
def test_dropout_written_as_keep_prob_is_named_at_the_first_step(tmp_path: Path, level: str) -> None:
    diag = train(tmp_path, mlp(dropout=nn.Dropout(0.9)), level)
    assert found(diag) == [("tf_convention", 0, "warning", "3")]
    alert = next(a for a in diag.alerts if a.kind == "tf_convention")
    assert "nn.Dropout(p=0.9) zeroes 90%" in alert.message and "keep_prob" in alert.hint
    assert table(tmp_path, level, "dropout_p") == {"3": pytest.approx(0.9)}


@pytest.mark.parametrize("level", PRESETS)
def test_leaky_relu_true_is_named_at_the_first_step(tmp_path: Path, level: str) -> None:
    diag = train(tmp_path, mlp(act=nn.LeakyReLU(True)), level)
    assert found(diag) == [("linear_activation", 0, "warning", "2")]
    alert = next(a for a in diag.alerts if a.kind == "linear_activation")
    assert "is the identity" in alert.message and "nn.LeakyReLU(0.2, inplace=True)" in alert.hint
    assert table(tmp_path, level, "leaky_slope") == {"2": 1.0}
    x = torch.randn(5, 3)
    assert torch.equal(nn.LeakyReLU(True)(x), x)  # why: the identity


@pytest.mark.parametrize("level", PRESETS)
def test_batch_norm_momentum_written_as_keras_is_named_at_the_first_step(tmp_path: Path, level: str) -> None:
    diag = train(tmp_path, mlp(norm=nn.BatchNorm1d(32, momentum=0.99)), level)
    assert found(diag) == [("tf_convention", 0, "warning", "1")]
    assert table(tmp_path, level, "bn_momentum") == {"1": pytest.approx(0.99)}


def test_what_the_momentum_does_to_the_running_statistics() -> None:
    """Why it matters: after a few batches the running mean is the last batch's, not the data's."""
    torch.manual_seed(0)
    keras, torch_default = nn.BatchNorm1d(4, momentum=0.99), nn.BatchNorm1d(4)
    batches = [torch.randn(8, 4) + 3 for _ in range(50)]
    for b in batches:
        keras(b), torch_default(b)
    last = batches[-1].mean(0)
    data = torch.cat(batches).mean(0)
    assert torch.allclose(keras.running_mean, last, atol=0.02)  # one batch's mean, noise included
    assert (torch_default.running_mean - data).abs().max() < (last - data).abs().max()


def test_both_in_one_model_each_named_once(tmp_path: Path) -> None:
    diag = train(tmp_path, mlp(dropout=nn.Dropout(0.85), norm=nn.BatchNorm1d(32, momentum=0.9)), steps=120)
    assert sorted(found(diag)) == [("tf_convention", 0, "warning", "1"), ("tf_convention", 0, "warning", "3")]


SILENT: dict[str, Callable[[], nn.Module]] = {
    "pytorch_defaults": lambda: mlp(),
    "dropout_0.5": lambda: mlp(dropout=nn.Dropout(0.5)),
    "dropout_0.7": lambda: mlp(dropout=nn.Dropout(0.7)),
    "layer_switched_off": lambda: mlp(dropout=nn.Dropout(1.0)),
    "momentum_0.01": lambda: mlp(norm=nn.BatchNorm1d(32, momentum=0.01)),
    "cumulative_average": lambda: mlp(norm=nn.BatchNorm1d(32, momentum=None)),
    "no_running_stats": lambda: mlp(norm=nn.BatchNorm1d(32, momentum=0.99, track_running_stats=False)),
    "leaky_relu_inplace": lambda: mlp(act=nn.LeakyReLU(inplace=True)),
    "leaky_relu_0.2": lambda: mlp(act=nn.LeakyReLU(0.2, True)),
}


@pytest.mark.parametrize("name", list(SILENT))
def test_pytorch_conventions_are_silent(tmp_path: Path, name: str) -> None:
    diag = train(tmp_path, SILENT[name]())
    assert found(diag) == []
    assert all(table(tmp_path, "advanced", what) == {} for what in ("dropout_p", "bn_momentum", "leaky_slope"))


def test_thresholds_are_settings(tmp_path: Path) -> None:
    diag = train(tmp_path, mlp(dropout=nn.Dropout(0.7)), probes={"layer_args": {"dropout_p": 0.6}})
    assert found(diag) == [("tf_convention", 0, "warning", "3")]
    with pytest.raises(ConfigError) as err:
        train(tmp_path, mlp(), probes={"layer_args": {"dropout_p": 0.0, "bn_momentum": 1.5}})
    assert "diag.probes.layer_args.dropout_p" in str(err.value) and "diag.probes.layer_args.bn_momentum" in str(err.value)

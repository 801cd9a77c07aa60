"""The references in docs/ are complete: every key a run of each preset logs is in docs/metrics.md,
every rule's alert kind is in docs/alerts.md, docs/config.md is what scripts/config_reference.py
writes from the code. These fail, on purpose, when someone adds a key, a kind or an option without
documenting it.

Documented keys are read from the first column of docs/metrics.md's tables: each backticked key,
``{a,b}`` expanded, ``<name>`` matching one path segment. Each preset runs a small loop that
exercises what the presets measure on a CPU: a ``GradScaler``, ``wrap_loader``, outputs and a labelled
batch, evaluations, enough steps for the due steps of every probe."""
from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import trackdiag
from trackdiag.core.registry import RULES
from trackdiag.core.record import read_records

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _expand(pattern: str) -> list[str]:
    """``diag/amp/{a,b}`` -> ``diag/amp/a``, ``diag/amp/b`` (several brace groups multiply)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(combo) for combo in itertools.product(*options)]


def documented_keys() -> list[re.Pattern[str]]:
    """Regexes of the keys in the first column of docs/metrics.md's tables."""
    out = []
    for line in (DOCS / "metrics.md").read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ")[0]
        for key in re.findall(r"`([^`]+)`", first):
            for one in _expand(key):
                regex = re.sub(r"<[^>]+>", "\x00", one)
                out.append(re.compile(re.escape(regex).replace("\x00", "[^/]+") + "$"))
    return out


def _run(level: str, out: Path) -> set[str]:
    """Every metric, histogram and table key a run of ``level`` writes to its local record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    data = torch.utils.data.TensorDataset(torch.randn(256, 20), torch.randint(0, 4, (256,)))
    loader = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    diag = trackdiag.Diagnostics(model, opt, scaler=scaler, level=level, sinks=["local"], output_dir=str(out))
    with diag:
        for _ in range(7):  # 56 steps: past every probe's first due steps at every preset
            for x, y in diag.wrap_loader(loader):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                diag.step(loss, outputs=logits, batch=(x, y))
            diag.log_eval(loss=loss.item(), accuracy=0.5)
    keys: set[str] = set()
    for record in read_records(out):
        keys |= {k for k, _, _ in record.points()} | set(record.histograms) | set(record.tables)
    return keys


@pytest.mark.parametrize("level", ["basic", "advanced", "extreme"])
def test_every_logged_key_is_documented(level: str, tmp_path: Path) -> None:
    keys = _run(level, tmp_path / level)
    assert len(keys) > 20, keys
    patterns = documented_keys()
    missing = sorted(k for k in keys if not any(p.match(k) for p in patterns))
    assert not missing, f"keys a {level} run logs that docs/metrics.md does not list: {missing}"
    assert any(p.match("diag/alerts/grad_explosion") for p in patterns)  # the trackers' alert counts


def test_the_key_check_can_fail() -> None:
    patterns = documented_keys()
    assert not any(p.match("diag/grad/undocumented_key") for p in patterns)
    assert any(p.match("diag/grad/norm/encoder.0") for p in patterns)
    assert not any(p.match("diag/grad/norm/a/b") for p in patterns)  # a placeholder is one path segment
    assert any(p.match("diag/amp/steps_without_optimizer") for p in patterns)  # braces expanded


def test_every_alert_kind_is_documented() -> None:
    text = (DOCS / "alerts.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `([a-z_]+)`", text, re.M))
    assert set(RULES.keys()) <= documented, f"rules whose kind docs/alerts.md lacks: {sorted(set(RULES) - documented)}"


def test_config_reference_is_current() -> None:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "config_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_docs_links_resolve() -> None:
    for page in [REPO / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+\.(?:md|png))(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).exists(), f"{page.name}: {target}"

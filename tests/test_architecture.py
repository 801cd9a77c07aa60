"""The package's layout holds: imports run down the stages only, no module imports itself in a circle.

The stages, lowest first, are listed in docs/development.md ("Imports between stages"). Every
``import``/``from ... import`` in the package counts, wherever it is written (inside a function, under
``TYPE_CHECKING``): a lazy import is still a dependency a reader has to follow.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "trackdiag"
#: lowest first; a module may import its own stage and the stages before it
STAGES = ("conf", "util", "core", "capture", "alerts", "forensics", "plots", "probes", "rules", "sinks", "compare",
          "config", "session", "hydra", "cli", "integrations")
FACE = {"trackdiag", "trackdiag.__main__", "trackdiag.hydra_callback"}  # the public face: may import any stage
MAX_FLOORS = 10


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (``from pkg import mod`` resolved to the module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t.startswith("trackdiag") and t in modules and t != name:
                found.add(t)
    return found


def _stage(name: str) -> str:
    return "face" if name in FACE else name.split(".")[1]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_belongs_to_a_stage(graph: dict[str, set[str]]) -> None:
    strays = sorted(m for m in graph if _stage(m) not in (*STAGES, "face"))
    assert not strays, f"modules outside the stages (put them in one; the top level is the public face only): {strays}"


def test_no_import_runs_back_up(graph: dict[str, set[str]]) -> None:
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() if _stage(m) != "face" for t in ts
                    if _stage(t) == "face" or STAGES.index(_stage(t)) > STAGES.index(_stage(m)))
    assert not upward, "imports from a lower stage into a higher one:\n" + "\n".join(upward)


def test_probes_rules_sinks_do_not_import_each_other(graph: dict[str, set[str]]) -> None:
    """Probes compute, rules judge, sinks write: the record between them is their only contract."""
    families = ("probes", "rules", "sinks")
    crossing = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                      if _stage(m) in families and _stage(t) in families and _stage(m) != _stage(t))
    assert not crossing, crossing


def test_no_import_circles(graph: dict[str, set[str]]) -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_floors(graph: dict[str, set[str]]) -> None:
    stage_edges: dict[str, set[str]] = defaultdict(set)
    for m, ts in graph.items():
        for t in ts:
            if _stage(t) != _stage(m):
                stage_edges[_stage(m)].add(_stage(t))
    floor: dict[str, int] = {}

    def height(s: str) -> int:
        if s not in floor:
            floor[s] = 1 + max((height(t) for t in stage_edges[s]), default=0)
        return floor[s]

    assert max(height(s) for s in (*STAGES, "face")) <= MAX_FLOORS, floor


def test_development_doc_lists_the_stages() -> None:
    doc = (ROOT.parent / "docs" / "development.md").read_text(encoding="utf-8")
    order = re.search(r"Stages, lowest first: (.+)", doc)
    assert order, "docs/development.md names the stages in order ('Stages, lowest first: ...')"
    assert re.findall(r"`(\w+)/`", order.group(1)) == list(STAGES)


def test_shared_constants_agree() -> None:
    """Where a rule restates a probe's constant (it may not import the probe), the two agree."""
    from trackdiag.probes import zerograd as probe
    from trackdiag.rules import zerograd as rule

    assert rule.NEAR == probe.NEAR

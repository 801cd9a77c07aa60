"""Byte-compile the Python files of what ``pip install 'trackdiag[all]'`` brings (trackdiag's requirements in
pyproject.toml and theirs, read from the installed packages' metadata: ~15,000 files), not of the whole environment
(~24,000: the test-only transformers, Ray, Lightning, Optuna, Playwright, pip itself). Where
``PYTHONDONTWRITEBYTECODE`` is set (this sandbox, CI) Python never writes a ``.pyc``, so without this every process
would compile torch, MLflow and Hydra in memory again (~5 CPU-s a process); the test suite compiles what else it
imports the first time it does (tests/conftest.py lets it write bytecode). Run by scripts/bootstrap.sh, beside the
old-versions venv: ``.venv/bin/python scripts/byte_compile.py``."""
from __future__ import annotations

import compileall
import importlib.metadata as metadata
import re
import sys
import tomllib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from packaging.requirements import Requirement


def requirements(pyproject: Path, extras: set[str]) -> list[Requirement]:
    """The project's requirements with ``extras`` (``trackdiag[wandb,plots]`` inside an extra expanded), read from
    pyproject.toml: not from the installed metadata, which pip is rewriting while this runs."""
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs, todo, done = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for line in project["optional-dependencies"].get(extra, []):
            req = Requirement(line)
            if req.name == project["name"]:
                todo.extend(req.extras)
            else:
                reqs.append(req)
    return reqs


def closure(reqs: list[Requirement]) -> set[str]:
    """The installed distributions ``reqs`` need, followed through every requirement whose marker holds here
    (the extras each requirement asks for included)."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r.name, frozenset(r.extras)) for r in reqs if r.marker is None or r.marker.evaluate()]
    while todo:
        name, wanted = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if (key, wanted) in seen:
            continue
        seen.add((key, wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional dependency that is not installed
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted or {""}):
                todo.append((req.name, frozenset(req.extras)))
    return {key for key, _ in seen}


def python_files(names: set[str]) -> list[str]:
    files: set[str] = set()
    for name in names:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        files.update(str(f.locate()) for f in dist.files or [] if f.suffix == ".py")
    return sorted(files)


def main() -> int:
    # trackdiag itself is not among them: pip compiles it when bootstrap.sh (re)installs it, while this runs
    files = python_files(closure(requirements(Path(__file__).resolve().parents[1] / "pyproject.toml", {"all"})))
    with ProcessPoolExecutor() as pool:  # one process per core, as ``compileall -j 0``
        list(pool.map(_compile, files, chunksize=64))
    print(f"byte_compile: {len(files)} files of trackdiag[all]'s dependencies", file=sys.stderr)
    return 0


def _compile(path: str) -> bool:
    """quiet=2: a file that is not Python 3 (a few packages ship test data as .py) is skipped, as pip skips it."""
    return bool(compileall.compile_file(path, quiet=2))


if __name__ == "__main__":
    sys.exit(main())

"""Name -> class registries for probes, rules and sinks, discovered from the packages.

Every module in ``trackdiag.probes``, ``trackdiag.rules`` and ``trackdiag.sinks`` is scanned once:
a probe class registers under its ``name``, a rule under its ``kind``, a sink under its ``name``.
Adding a component is adding a file. Sink modules import their optional packages (mlflow, wandb)
inside methods, so discovery stays cheap. A config entry may also carry ``_target_`` with the
dotted path of a user class, the Hydra way.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=None)
def _discover(package: str, attr: str) -> dict[str, type]:
    pkg = importlib.import_module(package)
    found: dict[str, type] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_") or info.name == "base":
            continue
        mod = importlib.import_module(f"{package}.{info.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            key = cls.__dict__.get(attr)
            own = cls.__module__ == mod.__name__ or (info.ispkg and cls.__module__.startswith(mod.__name__ + "."))
            if own and isinstance(key, str) and key:  # a package (sinks/mlflow/) registers what its __init__ exports
                found[key] = cls
    return found


class _Registry(dict):  # a dict that fills itself on first use
    def __init__(self, package: str, attr: str) -> None:
        super().__init__()
        self._package, self._attr = package, attr
        self._loaded = False

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            self.update(_discover(self._package, self._attr))

    def __getitem__(self, k: str) -> type:
        self._load()
        return super().__getitem__(k)

    def __contains__(self, k: object) -> bool:
        self._load()
        return super().__contains__(k)

    def __iter__(self):  # type: ignore[no-untyped-def]
        self._load()
        return super().__iter__()

    def keys(self):  # type: ignore[no-untyped-def]
        self._load()
        return super().keys()

    def values(self):  # type: ignore[no-untyped-def]
        self._load()
        return super().values()

    def items(self):  # type: ignore[no-untyped-def]
        self._load()
        return super().items()

    def get(self, k: str, default: Any = None) -> Any:
        self._load()
        return super().get(k, default)

    def __len__(self) -> int:
        self._load()
        return super().__len__()


PROBES: dict[str, type] = _Registry("trackdiag.probes", "name")
RULES: dict[str, type] = _Registry("trackdiag.rules", "kind")
SINKS: dict[str, type] = _Registry("trackdiag.sinks", "name")


def resolve(path: str) -> type:
    """Import ``"pkg.module:Class"`` or ``"pkg.module.Class"`` and return the class."""
    mod, sep, attr = path.partition(":")
    if not sep:
        mod, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(mod), attr)


def lookup(family: dict[str, type], name: str, entry: Any = None) -> type:
    """The class for ``name`` in ``family``, or the entry's ``_target_`` when it has one."""
    if isinstance(entry, dict) and entry.get("_target_"):
        return resolve(entry["_target_"])
    return family[name]

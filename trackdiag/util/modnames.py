"""Readable layer names for alert text: ``0`` of an ``nn.Sequential`` reads ``0 (Linear)``.

A module path whose last part is a bare index (a child of ``nn.Sequential`` / ``nn.ModuleList``:
``0``, ``blocks.3``) says nothing about what the layer is, so its module type is added. Other names
(``encoder.attn``) are left as they are. Cost: one ``get_submodule`` walk (path depth) per name, only
when an alert's text is written.
"""
from __future__ import annotations

from typing import Any

from torch import nn


def module_type(model: nn.Module | None, name: str) -> str:
    """The class name of ``model``'s submodule at ``name`` ("" when there is none)."""
    if model is None or not name or name.startswith("("):
        return ""
    try:
        return type(model.get_submodule(name)).__name__
    except (AttributeError, TypeError, ValueError):  # a coarsened or foreign name: no such module
        return ""


def needs_type(name: str) -> bool:
    """True when the last part of a module path is a bare index (``0``, ``blocks.3``)."""
    return bool(name) and name.rpartition(".")[2].isdigit()


def label(model: nn.Module | None, name: str, prefix: str = "") -> str:
    """``name`` (after ``prefix.`` when given) with its module type when it is a bare index: ``0 (Linear)``,
    ``G.blocks.3 (Block)``; else the qualified name unchanged."""
    full = f"{prefix}.{name}" if prefix and name else (name or prefix)
    kind = module_type(model, name) if needs_type(name) else ""
    return f"{full} ({kind})" if kind else full


def layer_label(comp: Any, layer: str) -> str:
    """The alert text of ``layer`` of component ``comp`` (a :class:`~trackdiag.capture.context.Component`):
    ``<component>.<layer>`` for a named component, with the module type for bare indices."""
    return label(getattr(comp, "model", None), layer, getattr(comp, "name", ""))


def layers_named(comp: Any, table: dict[str, float], most: int = 5) -> str:
    """The layers of a ``{layer: values}`` table, the largest first, labelled as :func:`layer_label`
    does: at most ``most`` of them, then ``(+N more)``."""
    layers = sorted(table, key=lambda k: -table[k])
    more = f" (+{len(layers) - most} more)" if len(layers) > most else ""
    return ", ".join(layer_label(comp, lay) for lay in layers[:most]) + more

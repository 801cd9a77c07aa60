"""trackdiag: training diagnostics for any PyTorch loop, streamed to MLflow or W&B.

The public face: :class:`Diagnostics` (the session), :class:`Alert` and :class:`Record` (what it
emits), the errors it raises. The stages behind it are laid out in docs/development.md.

``import trackdiag`` does not import torch: the session and the pre-flight report are loaded on first
use (``trackdiag.Diagnostics``, ``from trackdiag import Diagnostics``). The processes that never train
(the MLflow sink's worker, one per run; ``trackdiag compare`` and ``summary``) start without it: 1.1 s
of CPU and ~250 MB less each.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trackdiag.core.alert import Alert
from trackdiag.core.errors import AlertRaised, ConfigError, TrackdiagError
from trackdiag.core.record import Histogram, Record
from trackdiag.core.version import __version__
from trackdiag.integrations import optuna_sweep as _optuna_sweep

if TYPE_CHECKING:
    from trackdiag.forensics.preflight import PreflightReport
    from trackdiag.session.diagnostics import Diagnostics
    from trackdiag.session.disabled import DisabledDiagnostics

__all__ = ["Alert", "AlertRaised", "ConfigError", "Diagnostics", "DisabledDiagnostics", "Histogram", "PreflightReport", "Record",
           "TrackdiagError", "__version__"]

#: the names whose modules import torch: loaded by :func:`__getattr__` on first use
_LAZY = {"Diagnostics": "trackdiag.session.diagnostics", "DisabledDiagnostics": "trackdiag.session.disabled",
         "PreflightReport": "trackdiag.forensics.preflight"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trackdiag' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once: later look-ups find it without this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_optuna_sweep.install()  # a Hydra job that is an Optuna trial stops on alerts when diag.sweep.stop_on asks

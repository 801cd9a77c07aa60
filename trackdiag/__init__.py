"""trackdiag: training diagnostics for any PyTorch loop, streamed to MLflow or W&B.

The public face: :class:`Diagnostics` (the session), :class:`Alert` and :class:`Record` (what it
emits), the errors it raises. The stages behind it are laid out in docs/development.md.
"""
from trackdiag.core.alert import Alert
from trackdiag.core.errors import AlertRaised, ConfigError, TrackdiagError
from trackdiag.core.record import Histogram, Record
from trackdiag.core.version import __version__
from trackdiag.forensics.preflight import PreflightReport
from trackdiag.integrations import optuna_sweep as _optuna_sweep
from trackdiag.session.diagnostics import Diagnostics
from trackdiag.session.disabled import DisabledDiagnostics

__all__ = ["Alert", "AlertRaised", "ConfigError", "Diagnostics", "DisabledDiagnostics", "Histogram", "PreflightReport", "Record",
           "TrackdiagError", "__version__"]

_optuna_sweep.install()  # a Hydra job that is an Optuna trial stops on alerts when diag.sweep.stop_on asks

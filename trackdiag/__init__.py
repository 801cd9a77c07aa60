"""trackdiag: training diagnostics for any PyTorch loop, streamed to MLflow or W&B."""
from trackdiag.alert import Alert
from trackdiag.disabled import DisabledDiagnostics
from trackdiag.errors import AlertRaised, ConfigError, TrackdiagError
from trackdiag.preflight import PreflightReport
from trackdiag.record import Histogram, Record
from trackdiag.session import Diagnostics

__version__ = "0.1.0"
__all__ = ["Alert", "AlertRaised", "ConfigError", "Diagnostics", "DisabledDiagnostics", "Histogram", "PreflightReport", "Record",
           "TrackdiagError", "__version__"]

"""trackdiag inside the training loops people already use.

* :mod:`trackdiag.integrations.lightning`: ``DiagnosticsCallback`` for Lightning 2.x
  (``pip install 'trackdiag[lightning]'``);
* :mod:`trackdiag.integrations.transformers`: ``DiagnosticsCallback`` for the Hugging Face
  ``Trainer`` (transformers 5.x; ``pip install 'trackdiag[transformers]'``).

Both build a :class:`trackdiag.Diagnostics` session when training starts, call ``step()`` once per
real optimizer step and ``log_eval()`` after each validation, and write into the run the framework's
own MLflow / W&B integration opened (one run holding the framework's metrics and ``diag/*``).
Nothing is imported from a framework until its module is imported.
"""
from __future__ import annotations

__all__: list[str] = []

"""The Hydra callback's documented path, ``trackdiag.hydra_callback.CompareCallback`` (a config entry point:
``hydra.callbacks.<name>._target_``). It lives in :mod:`trackdiag.hydra.callback`."""
from trackdiag.hydra.callback import CompareCallback, log_to_mlflow_parent

__all__ = ["CompareCallback", "log_to_mlflow_parent"]

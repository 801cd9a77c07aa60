"""The MLflow sink (:class:`~trackdiag.sinks.mlflow.sink.MlflowSink`) and its delivery: a worker process,
a local spool for outages, batching within ``log_batch``'s limits, media, sweeps' parent runs.
"""
from trackdiag.sinks.mlflow.sink import MlflowSink

__all__ = ["MlflowSink"]

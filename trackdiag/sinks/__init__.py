"""Sinks write records and alerts somewhere; one backend per file, optional deps imported lazily."""
from trackdiag.sinks.base import Sink

__all__ = ["Sink"]

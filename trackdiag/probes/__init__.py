"""Probes compute diagnostics as device tensors; one file per probe family."""
from trackdiag.probes.base import Probe

__all__ = ["Probe"]

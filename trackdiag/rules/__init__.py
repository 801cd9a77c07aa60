"""Rules judge records and emit alerts; one file per rule family."""
from trackdiag.rules.base import Rule

__all__ = ["Rule"]

"""The package version (one place: the face and the tracker tags read it)."""
__version__ = "0.1.0"

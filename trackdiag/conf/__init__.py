"""Packaged Hydra configs: the ``diag`` group (presets basic, advanced, extreme)."""

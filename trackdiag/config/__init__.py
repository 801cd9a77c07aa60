"""Diagnostics configs: presets merged with overrides and validated in one pass (one ``ConfigError``).
"""

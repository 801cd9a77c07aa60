"""The vocabulary the stages share: :class:`Record`, :class:`Alert` and the alert policy's severities,
the errors, the component registry, the packaged presets and :class:`RunInfo`. Imports only ``util``.
"""

"""The :class:`~trackdiag.session.diagnostics.Diagnostics` session: the step and close paths, probe/rule
guards, set-up checks, the cost budget, the crash exit path, cross-rank reduction, the disabled session.
"""

"""Hydra sweeps: the ``CompareCallback`` and the sweep's parent run, ledger and end (one comparison per sweep).
"""

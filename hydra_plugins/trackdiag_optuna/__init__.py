"""``hydra/sweeper=trackdiag_optuna``: an Optuna 5 study drives a Hydra multirun, and trials that
trackdiag stops on alerts are told to the study as pruned (or failed). See :mod:`.sweeper`.

Hydra imports every ``hydra_plugins.*`` module at every app start: this package imports only Hydra
at that point (Optuna when a sweep starts).
"""

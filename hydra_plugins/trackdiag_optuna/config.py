"""The sweeper's config node, in Hydra's ConfigStore as ``hydra/sweeper=trackdiag_optuna``."""
from dataclasses import dataclass, field
from typing import Dict, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class TrackdiagOptunaSweeperConf:
    _target_: str = "hydra_plugins.trackdiag_optuna.sweeper.TrackdiagOptunaSweeper"
    storage: Optional[str] = None  # an Optuna storage URL; null: sqlite:///<sweep dir>/optuna.db
    study_name: Optional[str] = None  # null: a new study named by Optuna (load_if_exists otherwise)
    direction: str = "minimize"  # minimize | maximize: what the task function's return value is
    n_trials: int = 20
    n_jobs: int = 2  # trials asked and launched together, one batch through the configured launcher
    seed: Optional[int] = None  # the sampler's seed
    sampler: str = "tpe"  # tpe | random | grid (every param a choice or range)
    pruner: Optional[str] = None  # null: only trackdiag stops trials; median: Optuna's MedianPruner too
    # search space: lr: tag(log, interval(1e-4, 1e2)) | choice(a, b) | a,b,c | range(1, 5)
    params: Dict[str, str] = field(default_factory=dict)


ConfigStore.instance().store(group="hydra/sweeper", name="trackdiag_optuna", node=TrackdiagOptunaSweeperConf,
                             provider="trackdiag")

"""A Hydra sweeper on Optuna 5 whose jobs are Optuna trials that trackdiag can stop.

``python train.py -m hydra/sweeper=trackdiag_optuna '+hydra.sweeper.params.optimizer.lr=tag(log, interval(1e-4, 1e2))'
+diag=advanced 'diag.sweep.stop_on=[critical]'``: the sweeper asks the study (``hydra.sweeper.storage``,
``study_name``, ``direction``, ``seed``) for ``n_jobs`` trials at a time, launches them as one batch
through the configured launcher, and tells the study each job's return value. Each job gets its trial
through ``hydra.job.env_set`` (``TRACKDIAG_OPTUNA_TRIAL``: the trial's id; ``TRACKDIAG_OPTUNA_STUDY``: the
sweep dir's ``optuna_study.json``, storage URL and study name): with ``diag.sweep.stop_on`` set, the
job's trackdiag session stops on a matching alert and the sweeper tells that trial PRUNED
(``diag.sweep.on_stop=prune``) or FAIL (``fail``), with the alert in its user attributes
(``trackdiag.stop.reason``, ``trackdiag.stop.*``). A job that raises or returns no number is FAIL.

Search space (``hydra.sweeper.params`` or sweep overrides on the command line): ``interval(a, b)``
(float; ``tag(int, interval(a, b))`` for ints), ``tag(log, interval(a, b))`` (log scale), ``range(a, b[, step])``,
``choice(x, y)`` or ``x,y`` (categorical). Plain overrides are passed to every trial.
Writes ``multirun.yaml`` and ``optimization_results.yaml`` (best params and value) into the sweep dir.
"""
from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep
from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import HydraException
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
STUDY_FILE = "optuna_study.json"


def distribution(override: Override) -> Any:
    """The Optuna distribution of one sweep override (see the module doc); HydraException otherwise."""
    import optuna.distributions as d

    value, key = override.value(), override.get_key_element()
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        if "int" in value.tags:  # Hydra parses an interval's ends as floats
            return d.IntDistribution(int(value.start), int(value.end), log=log_scale)
        return d.FloatDistribution(float(value.start), float(value.end), log=log_scale)
    if isinstance(value, RangeSweep):
        return d.CategoricalDistribution(list(value.range()))
    if isinstance(value, ChoiceSweep):
        plain = all(isinstance(v, (bool, int, float, str)) or v is None for v in value.list)
        return d.CategoricalDistribution(list(value.list) if plain else list(override.sweep_string_iterator()))
    raise HydraException(f"trackdiag_optuna: {key}: {override.input_line!r} is no search space "
                         "(use interval(a, b), tag(log, interval(a, b)), range(a, b), choice(x, y) or x,y)")


def search_space(overrides: List[Override]) -> Tuple[Dict[str, Any], List[str]]:
    """``(key -> distribution, fixed overrides)`` from the parsed params and command line."""
    space: Dict[str, Any] = {}
    fixed: List[str] = []
    for o in overrides:
        if o.is_sweep_override():
            space[o.get_key_element()] = distribution(o)
        else:
            fixed.append(f"{o.get_key_element()}={o.get_value_element_as_str()}")
    return space, fixed


def _storage_url(storage: Optional[str], sweep_dir: Path) -> str:
    """The storage URL jobs can open from any working dir: a relative SQLite path made absolute."""
    if not storage:
        return f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"
    if storage.startswith("sqlite:///") and not storage.startswith("sqlite:////"):
        return f"sqlite:///{Path(storage[len('sqlite:///'):]).resolve()}"
    return storage


class TrackdiagOptunaSweeper(Sweeper):
    """Optuna 5 study -> batches of Hydra jobs -> told results (see the module doc)."""

    def __init__(self, storage: Optional[str] = None, study_name: Optional[str] = None, direction: str = "minimize",
                 n_trials: int = 20, n_jobs: int = 2, seed: Optional[int] = None, sampler: str = "tpe",
                 pruner: Optional[str] = None, params: Optional[Dict[str, str]] = None) -> None:
        problems = []
        if direction not in ("minimize", "maximize"):
            problems.append(f"hydra.sweeper.direction: {direction!r}; accepted: minimize, maximize")
        if sampler not in ("tpe", "random", "grid"):
            problems.append(f"hydra.sweeper.sampler: {sampler!r}; accepted: tpe, random, grid")
        if pruner not in (None, "median"):
            problems.append(f"hydra.sweeper.pruner: {pruner!r}; accepted: null, median")
        for name, v in (("n_trials", n_trials), ("n_jobs", n_jobs)):
            if not isinstance(v, int) or v < 1:
                problems.append(f"hydra.sweeper.{name}: {v!r} is not a count >= 1")
        if problems:
            raise HydraException("trackdiag_optuna sweeper config: " + "; ".join(problems))
        self.storage, self.study_name, self.direction = storage, study_name, direction
        self.n_trials, self.n_jobs, self.seed, self.sampler, self.pruner = n_trials, n_jobs, seed, sampler, pruner
        self.params = dict(params or {})
        self.config: Optional[DictConfig] = None
        self.hydra_context: Optional[HydraContext] = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config, self.hydra_context = config, hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                 task_function=task_function, config=config)

    def _study(self, sweep_dir: Path, space: Dict[str, Any]) -> Any:
        import optuna

        if self.sampler == "grid":  # every combination enqueued, asked in order (GridSampler stops the study from tell())
            if not all(isinstance(d, optuna.distributions.CategoricalDistribution) for d in space.values()):
                raise HydraException("trackdiag_optuna: sampler=grid needs choice(...) or range(...) for every param")
            sampler: Any = optuna.samplers.RandomSampler(seed=self.seed)
        elif self.sampler == "random":
            sampler = optuna.samplers.RandomSampler(seed=self.seed)
        else:
            sampler = optuna.samplers.TPESampler(seed=self.seed)
        pruner = optuna.pruners.MedianPruner() if self.pruner == "median" else optuna.pruners.NopPruner()
        storage = _storage_url(self.storage, sweep_dir)
        study = optuna.create_study(storage=storage, study_name=self.study_name, direction=self.direction,
                                    sampler=sampler, pruner=pruner, load_if_exists=self.study_name is not None)
        if self.sampler == "grid":
            keys = list(space)
            for combo in itertools.product(*(space[k].choices for k in keys)):
                study.enqueue_trial(dict(zip(keys, combo)), skip_if_exists=True)
        (sweep_dir / STUDY_FILE).write_text(json.dumps({"storage": storage, "study_name": study.study_name}))
        return study

    def sweep(self, arguments: List[str]) -> List[Sequence[JobReturn]]:
        """Run ``n_trials`` trials, ``n_jobs`` at a time; returns the batches' job returns."""
        from trackdiag.integrations.optuna_sweep import ENV_STUDY, ENV_TRIAL

        if self.config is None or self.launcher is None or self.hydra_context is None:
            raise HydraException("trackdiag_optuna: sweep() before setup()")
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        space, fixed = search_space(overrides)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        study = self._study(sweep_dir, space)
        study_file = (sweep_dir / STUDY_FILE).resolve()
        returns: List[Sequence[JobReturn]] = []
        done = 0
        while done < self.n_trials:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            batch = [[*fixed, *(f"{k}={_show(v)}" for k, v in t.params.items()),
                      f"+hydra.job.env_set.{ENV_TRIAL}={t._trial_id}",
                      f"+hydra.job.env_set.{ENV_STUDY}='{study_file}'"] for t in trials]
            self.validate_batch_is_legal(batch)
            results = self.launcher.launch(batch, initial_job_idx=done)
            for trial, ret in zip(trials, results):
                self._tell(study, trial, ret)
            done += len(trials)
            returns.append(results)
        self._write_results(study, sweep_dir)
        return returns

    def _tell(self, study: Any, trial: Any, ret: JobReturn) -> None:
        """Tell the study how ``trial`` ended: PRUNED/FAIL when trackdiag stopped it, its value otherwise."""
        from optuna.trial import TrialState

        attrs = study._storage.get_trial_user_attrs(trial._trial_id)
        if attrs.get("trackdiag.stopped"):
            reason = (f"trackdiag {attrs.get('trackdiag.stop.severity')} {attrs.get('trackdiag.stop.kind')} at step "
                      f"{attrs.get('trackdiag.stop.alert_step')}: {attrs.get('trackdiag.stop.message')}")
            study._storage.set_trial_user_attr(trial._trial_id, "trackdiag.stop.reason", reason)
            state = TrialState.FAIL if attrs.get("trackdiag.on_stop") == "fail" else TrialState.PRUNED
            log.info("trial %d %s: %s", trial.number, state.name, reason)
            study.tell(trial, state=state)
            return
        value = ret._return_value if ret.status == JobStatus.COMPLETED else None
        try:
            number = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            number = float("nan")
        if ret.status != JobStatus.COMPLETED or not math.isfinite(number):
            why = f"job failed: {ret._return_value!r}" if ret.status != JobStatus.COMPLETED else f"returned {value!r}"
            study._storage.set_trial_user_attr(trial._trial_id, "trackdiag.fail_reason", why[:500])
            log.warning("trial %d FAIL: %s", trial.number, why[:500])
            study.tell(trial, state=TrialState.FAIL)
            return
        study.tell(trial, number)

    def _write_results(self, study: Any, sweep_dir: Path) -> None:
        from optuna.trial import TrialState

        done = [t for t in study.trials if t.state == TrialState.COMPLETE]
        states = {s.name: sum(t.state == s for t in study.trials) for s in TrialState if s.is_finished()}
        out: Dict[str, Any] = {"name": "trackdiag_optuna", "study_name": study.study_name, "trials": states}
        if done:
            out.update(best_params=dict(study.best_trial.params), best_value=study.best_value,
                       best_trial=study.best_trial.number)
        OmegaConf.save(OmegaConf.create(out), sweep_dir / "optimization_results.yaml")
        log.info("trackdiag_optuna: %s; best: %s", states, out.get("best_params"))


def _show(v: Any) -> str:
    """A sampled value as a Hydra override value (floats by repr: 1e-05, 0.001)."""
    return repr(v) if isinstance(v, float) else str(v)

"""Load a sweep from any source and write the comparison outputs.

``compare(source)`` returns a :class:`Comparison`; ``write_outputs(comparison, out_dir)`` writes
``comparison.csv``, ``comparison.json``, ``comparison.html`` and (unless ``plots=False``) the PNG
plots. Sources: a local dir (Hydra multirun dir or any tree of run dirs), ``mlflow:<experiment>``,
``wandb:<entity>/<project>[/<group>]``, ``optuna:<storage-url>#<study>`` (the study's trials joined
to their runs' local records).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trackdiag.compare.risk import ParamRisk, headline, param_risk, risk_lines
from trackdiag.compare.runs import CompareError, Progress, RunSummary, alert_kinds, swept_params
from trackdiag.compare.trials import stop_totals

log = logging.getLogger(__name__)


@dataclass
class Comparison:
    """The runs of a sweep (most severe first), the parameters that differ and the risk per value."""

    source: str
    runs: list[RunSummary]
    swept: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    risks: list[ParamRisk] = field(default_factory=list)

    @classmethod
    def build(cls, source: str, runs: list[RunSummary]) -> "Comparison":
        """Sort the runs, find the swept parameters and alert kinds, compute the risk per value."""
        runs = sorted(runs, key=RunSummary.sort_key)
        swept = swept_params(runs)
        return cls(source=source, runs=runs, swept=swept, kinds=alert_kinds(runs), risks=param_risk(runs, swept))

    @property
    def headline(self) -> str:
        """``12 runs: 3 critical, 1 warning, 8 ok``."""
        return headline(self.runs)

    @property
    def risk_lines(self) -> list[str]:
        """``optimizer.lr=0.1: 4/4 runs anomalous (loss_divergence)`` ..., decisive parameters first."""
        return risk_lines(self.risks)

    @property
    def has_trials(self) -> bool:
        """Whether any run is an Optuna trial (the table then has the trial columns)."""
        return any(r.trial for r in self.runs)

    @property
    def stops(self) -> dict[str, Any]:
        """``{trials, stopped, steps_saved, seconds_saved}``: what trackdiag's stops saved the study."""
        return stop_totals(self.runs)

    @property
    def stop_line(self) -> str:
        """``8 trials: 2 stopped by trackdiag, 64 steps (3.1 s) saved``."""
        s = self.stops
        return (f"{s['trials']} trials: {s['stopped']} stopped by trackdiag, {s['steps_saved']} steps "
                f"({s['seconds_saved']:.1f} s) saved")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form of everything (``stops`` when any run is an Optuna trial)."""
        return {"source": self.source, "headline": self.headline, "swept": self.swept, "kinds": self.kinds,
                "runs": [r.to_dict() for r in self.runs], "risk": [p.to_dict() for p in self.risks],
                "risk_lines": self.risk_lines, **({"stops": self.stops} if self.has_trials else {})}


def load_runs(source: str | Path, *, tracking_uri: str | None = None, parent: str | None = None,
              sweep: str | None = None, progress: Progress | None = None) -> list[RunSummary]:
    """The runs of ``source``; raises :class:`CompareError` with what to do when it can't be read.
    ``parent`` / ``sweep`` (MLflow only): the children of that parent run, or of the sweep whose
    dir ends with ``sweep``."""
    text = str(source)
    if text == "mlflow" or text.startswith("mlflow:"):
        from trackdiag.compare.mlflow_source import load_mlflow

        return load_mlflow(text[len("mlflow:"):], tracking_uri=tracking_uri, parent=parent, sweep=sweep,
                           progress=progress)
    if text.startswith("optuna:"):
        from trackdiag.compare.optuna_source import load_optuna

        return load_optuna(text[len("optuna:"):], progress=progress)
    if text.startswith("wandb:"):
        from trackdiag.compare.wandb_source import load_wandb

        return load_wandb(text[len("wandb:"):], progress=progress)
    if parent is not None or sweep is not None:
        raise CompareError("--parent and --sweep only apply to mlflow:<experiment> sources")
    from trackdiag.compare.local import load_local

    return load_local(text, progress=progress)


def compare(source: str | Path, *, tracking_uri: str | None = None, parent: str | None = None,
            sweep: str | None = None, progress: Progress | None = None) -> Comparison:
    """Load ``source`` and build its :class:`Comparison`. Raises :class:`CompareError` if it holds no run."""
    runs = load_runs(source, tracking_uri=tracking_uri, parent=parent, sweep=sweep, progress=progress)
    if not runs:
        raise CompareError(f"no runs found in {source}")
    return Comparison.build(str(source), runs)

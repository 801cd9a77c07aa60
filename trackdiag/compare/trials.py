"""Optuna trials in a comparison: which runs were trials, which trackdiag stopped, and what that saved.

A run's trial comes from its local record's ``trial.json`` (written by
:mod:`trackdiag.integrations.optuna`) or from the study itself (:mod:`trackdiag.compare.optuna_source`).
The table gets the columns :data:`COLUMNS` when any run is a trial; :func:`stop_totals` sums what the
stops saved (the sweep's parent run logs it). Costs: one small JSON read per run dir.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from trackdiag.compare.safe_read import UnreadableFile, clip, read_json

if TYPE_CHECKING:
    from trackdiag.compare.runs import RunSummary

TRIAL_FILE = "trial.json"  # the name integrations/optuna.py writes (a lower stage may not import it)
#: table columns of a run that is a trial
COLUMNS = ("trial", "state", "value", "stopped", "stop_step", "steps_saved")


def trial_info(number: Any = None, state: Any = None, value: Any = None, stop: Mapping[str, Any] | None = None,
               reason: str | None = None) -> dict[str, Any]:
    """The ``RunSummary.trial`` dict (``trial``: the trial's number; ``stopped``: the stop's alert kind,
    None when not stopped; ``steps_saved``/``seconds_saved``: against the planned steps)."""
    stop = stop or {}
    kind = stop.get("kind")
    if kind and not reason:
        reason = f"trackdiag {stop.get('severity')} {kind} at step {stop.get('alert_step')}: {stop.get('message')}"
    return {"trial": _int(number), "state": clip(str(state), 20) if state is not None else None,
            "value": _num(value), "stopped": clip(str(kind), 80) if kind else None,
            "stop_step": _int(stop.get("stop_step")), "steps_saved": _int(stop.get("steps_saved")),
            "seconds_saved": _num(stop.get("seconds_saved")), "reason": clip(reason, 500) if reason else None}


def read_trial_file(run_dir: Path) -> dict[str, Any] | None:
    """``trial.json`` of a run dir as a trial dict; None when absent or unreadable (never raises)."""
    try:
        doc = read_json(run_dir / TRIAL_FILE)
    except UnreadableFile:
        return None
    if not isinstance(doc, Mapping):
        return None
    stop = doc.get("stopped") if isinstance(doc.get("stopped"), Mapping) else None
    state = None if stop is None else ("FAIL" if doc.get("on_stop") == "fail" else "PRUNED")
    return trial_info(doc.get("number"), state, None, stop)


def cells(trial: Mapping[str, Any] | None) -> list[str]:
    """Display cells for :data:`COLUMNS` (blanks for a run that is no trial)."""
    if not trial:
        return [""] * len(COLUMNS)
    value = trial.get("value")
    return ["" if trial.get(k) is None else (f"{value:.4g}" if k == "value" else str(trial[k])) for k in COLUMNS]


def row(trial: Mapping[str, Any] | None) -> dict[str, Any]:
    """CSV/JSON columns for :data:`COLUMNS` plus ``seconds_saved``."""
    t = trial or {}
    return {**{k: t.get(k) for k in COLUMNS}, "seconds_saved": t.get("seconds_saved")}


def stop_totals(runs: Iterable["RunSummary"]) -> dict[str, Any]:
    """``{trials, stopped, steps_saved, seconds_saved}`` over the runs that are trials."""
    trials = [r.trial for r in runs if r.trial]
    stopped = [t for t in trials if t.get("stopped")]
    return {"trials": len(trials), "stopped": len(stopped),
            "steps_saved": sum(t.get("steps_saved") or 0 for t in stopped),
            "seconds_saved": round(sum(t.get("seconds_saved") or 0.0 for t in stopped), 3)}


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf") else None

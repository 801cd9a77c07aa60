"""The :class:`RunSummary` every source produces, and the helpers they share.

A source (local records, MLflow, W&B) reduces each run to one ``RunSummary``; everything
downstream (table, risk, plots, HTML) reads only these.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping

from trackdiag.compare.safe_read import MAX_DEPTH, UnreadableFile, clip, clip_value, parse_json
from trackdiag.core.errors import TrackdiagError

#: What a run that never ran trackdiag reads as in the health column (a plain MLflow run, a Hydra job
#: without ``diag``): neither failed nor healthy, just not diagnosed.
NO_TRACKDIAG = "no trackdiag"
#: Sort order of health values: most severe first.
HEALTH_RANK = {"critical": 0, "warning": 1, "failed": 2, "unknown": 3, "ok": 4, NO_TRACKDIAG: 5}
#: Hyperparameter keys that are trackdiag's own settings (the Hydra ``diag`` node, W&B's ``trackdiag``
#: section): compared only between runs that have them, listed after the user's own.
SETTINGS_PREFIXES = ("diag.", "trackdiag.")
#: Run statuses that mean the run did not end normally.
FAILED_STATUSES = frozenset({"FAILED", "KILLED", "CRASHED"})
#: Most points kept per loss curve (curves are for plots, not analysis).
MAX_CURVE_POINTS = 300
#: Most hyperparameters kept per run.
MAX_HPARAMS = 5000



class _Missing:
    """A hyperparameter a run does not have (tables and risk lines read ``(unset)``, not ``null``)."""

    _instance: "_Missing | None" = None

    def __new__(cls) -> "_Missing":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __str__(self) -> str:
        return "(unset)"


MISSING = _Missing()

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called by sources while they read runs."""


class CompareError(TrackdiagError):
    """A comparison source cannot be read (missing dir, unknown experiment, no server...)."""


@dataclass
class RunSummary:
    """One run, reduced to what a sweep comparison needs.

    name: the run's name; label: a short name for tables (``#3`` for Hydra job 3).
    source_id: where it came from (local dir, MLflow run id, W&B run path).
    status: ``FINISHED | FAILED | KILLED | RUNNING | CRASHED | UNKNOWN``. health: ``ok | warning |
        critical | unknown`` (unknown: no diagnostics record). diagnosed: False for a run that never
        ran trackdiag (its health column reads ``no trackdiag``; risk lines leave it out).
    hparams: flattened hyperparameters (dotted keys). overrides: Hydra overrides, when known.
    job_num / group: Hydra job number and sweep (sweep dir, MLflow parent run, W&B group).
    alert_counts / first_steps / severities: per alert kind.
    first_anomaly: first step of any warning or critical alert, else None.
    final_loss / best_loss: last and lowest finite train loss (``diag/loss``); best_eval_loss:
        lowest finite ``diag/eval/loss``. loss_curve: ``[(step, loss), ...]``, downsampled.
    trial: the Optuna trial the run was (``trial.json`` / the study): trial (its number), state, value, stopped,
        stop_step, steps_saved, seconds_saved, reason; None outside a study.
    """

    name: str
    source_id: str
    status: str = "FINISHED"
    health: str = "unknown"
    label: str = ""
    hparams: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    alert_counts: dict[str, int] = field(default_factory=dict)
    first_steps: dict[str, int] = field(default_factory=dict)
    severities: dict[str, str] = field(default_factory=dict)
    first_anomaly: int | None = None
    steps: int | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    best_eval_loss: float | None = None
    loss_curve: list[tuple[int, float]] = field(default_factory=list)
    job_num: int | None = None
    group: str | None = None
    note: str = ""
    diagnosed: bool = True
    trial: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # cut every text early (whatever the source): tables, plots and risk lines stay linear and small
        self.name, self.source_id = clip(str(self.name)), clip(str(self.source_id))
        self.status = clip(str(self.status), 40)
        self.health, self.note = clip(str(self.health), 40), clip(str(self.note), 2000)
        self.group = clip(str(self.group)) if self.group is not None else None
        self.hparams = {clip(str(k)): clip_value(v) for k, v in list(self.hparams.items())[:MAX_HPARAMS]}
        self.overrides = [clip(str(o)) for o in self.overrides[:1000]]
        if not self.label:
            self.label = f"#{self.job_num}" if self.job_num is not None else self.name
        self.label = clip(str(self.label))

    @property
    def failed(self) -> bool:
        """True when the run did not end normally (crashed, failed, killed)."""
        return self.status in FAILED_STATUSES

    @property
    def anomalous(self) -> bool:
        """True when the run raised at least one warning or critical alert."""
        return self.first_anomaly is not None or self.health in ("warning", "critical")

    @property
    def display_health(self) -> str:
        """Health for tables: a run without trackdiag reads ``no trackdiag``, a failed run without
        alerts ``failed``."""
        if not self.diagnosed:
            return NO_TRACKDIAG
        if self.failed and self.health in ("ok", "unknown"):
            return "failed"
        return self.health

    def sort_key(self) -> tuple[Any, ...]:
        """Most severe first, then earliest anomaly, then name."""
        first = self.first_anomaly if self.first_anomaly is not None else math.inf
        return HEALTH_RANK.get(self.display_health, 3), first, self.job_num if self.job_num is not None else math.inf, self.name

    def anomaly_kinds(self) -> list[str]:
        """Alert kinds of warning or critical severity (unknown severity counts), by first step; the
        crash a failed run's status names is not one."""
        kinds = [k for k in self.alert_counts if self.severities.get(k, "warning") != "info" and k not in FAILURE_KINDS]
        return sorted(kinds, key=lambda k: (self.first_steps.get(k, math.inf), k))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (non-finite losses become None)."""
        d = asdict(self)
        for k in ("final_loss", "best_loss", "best_eval_loss"):
            d[k] = finite_or_none(d[k])
        d["loss_curve"] = [[s, finite_or_none(v)] for s, v in self.loss_curve]
        d["display_health"] = self.display_health
        d["anomalous"] = self.anomalous
        return d


def finite_or_none(v: float | None) -> float | None:
    """``v`` if it is a finite number, else None."""
    return v if v is not None and isinstance(v, (int, float)) and math.isfinite(v) else None


def flatten(d: Mapping[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """Nested mappings to dotted keys: ``{"optimizer": {"lr": 1e-3}}`` -> ``{"optimizer.lr": 1e-3}``.

    Below :data:`~trackdiag.compare.safe_read.MAX_DEPTH` levels a mapping is kept as one (clipped) value.
    """
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v and depth < MAX_DEPTH:
            out.update(flatten(v, key + ".", depth + 1))
        else:
            out[key] = clip_value(v) if isinstance(v, Mapping) else v
    return out


def parse_value(text: str) -> Any:
    """A string parameter (MLflow stores params as text) back to int/float/bool/None when it is one."""
    t = text.strip()
    if t[:1] in ("[", "{"):  # lists and mappings are logged as JSON
        try:
            return parse_json(t, "param")
        except UnreadableFile:
            return text
    if t in ("None", "null", "~"):
        return None
    if t in ("True", "true"):
        return True
    if t in ("False", "false"):
        return False
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            continue
    return text


def loss_stats(points: Iterable[tuple[int, float]]) -> tuple[float | None, float | None, list[tuple[int, float]]]:
    """(final, best, downsampled curve) of a loss series. Final may be non-finite; best is finite."""
    pts = sorted(points, key=lambda p: p[0])
    if not pts:
        return None, None, []
    finite = [v for _, v in pts if math.isfinite(v)]
    stride = max(1, math.ceil(len(pts) / MAX_CURVE_POINTS))
    curve = pts[::stride]
    if curve[-1] != pts[-1]:
        curve.append(pts[-1])
    return pts[-1][1], (min(finite) if finite else None), curve


def best_finite(values: Iterable[float]) -> float | None:
    """The lowest finite value, or None."""
    finite = [v for v in values if math.isfinite(v)]
    return min(finite) if finite else None


def health_from_severities(severities: Iterable[str]) -> str:
    """The run health the alert book would give: critical > warning > ok (info counts as ok)."""
    sev = set(severities)
    if "critical" in sev:
        return "critical"
    return "warning" if sev - {"info"} else "ok"


#: alert kinds that describe the failure the run's status names (FAILED, KILLED), not an anomaly of training
FAILURE_KINDS = frozenset({"crash"})


def first_anomaly(first_steps: Mapping[str, int], severities: Mapping[str, str]) -> int | None:
    """Earliest first step over alert kinds that are not ``info`` (nor the crash the status names)."""
    steps = [s for k, s in first_steps.items() if severities.get(k, "warning") != "info" and k not in FAILURE_KINDS]
    return min(steps) if steps else None


def training_health(health: str, severities: Mapping[str, str]) -> str:
    """The run's health from its training alerts: a ``crash`` finding is the failure its status names
    (a run that died shows ``failed``), so it does not make the run critical on its own."""
    if not any(k in FAILURE_KINDS for k in severities):
        return health
    return health_from_severities(v for k, v in severities.items() if k not in FAILURE_KINDS)


def is_setting(key: str) -> bool:
    """True for trackdiag's own settings (``diag.every``), False for the user's hyperparameters."""
    return key.startswith(SETTINGS_PREFIXES)


def swept_params(runs: Iterable[RunSummary]) -> list[str]:
    """Hyperparameter keys whose value differs between runs: the user's first (a key missing in a run
    counts as a value), then trackdiag settings whose value differs between the runs that have them
    (a preset without a probe, or a run without trackdiag, does not make every setting a column).

    Runs with no hyperparameters at all (a source that could not read them) are ignored.
    """
    runs = [r for r in runs if r.hparams]
    keys = sorted({k for r in runs for k in r.hparams})
    user = [k for k in keys if not is_setting(k) and len({repr(r.hparams.get(k, MISSING)) for r in runs}) > 1]
    settings = [k for k in keys if is_setting(k) and len({repr(r.hparams[k]) for r in runs if k in r.hparams}) > 1]
    return user + settings


def alert_kinds(runs: Iterable[RunSummary]) -> list[str]:
    """Every alert kind seen in any run, most frequent first."""
    totals: dict[str, int] = {}
    for r in runs:
        for k, n in r.alert_counts.items():
            totals[k] = totals.get(k, 0) + n
    return sorted(totals, key=lambda k: (-totals[k], k))


def format_value(v: Any) -> str:
    """Compact display of a hyperparameter value (``0.001`` -> ``0.001``, ``1e-05`` stays)."""
    if isinstance(v, float):
        return f"{v:g}"
    return "null" if v is None else str(v)  # MISSING reads "(unset)"

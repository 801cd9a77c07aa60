"""Anomaly rate per value of each swept hyperparameter.

``optimizer.lr=0.1: 4/4 runs anomalous (loss_divergence, grad_explosion)`` — the question a sweep
answers about stability: which settings make training break. A run is anomalous when it raised a
warning or critical alert; failed runs are counted apart (a crash is not a diagnosis). Runs that
never ran trackdiag are left out (nothing was diagnosed), and so are runs without a trackdiag setting
in that setting's lines; a user hyperparameter a run lacks reads ``(unset)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from trackdiag.compare.runs import MISSING, NO_TRACKDIAG, RunSummary, format_value, is_setting


@dataclass
class ValueRisk:
    """Runs that had ``param == value``: how many, how many anomalous / failed, which alert kinds."""

    value: Any
    runs: int = 0
    anomalous: int = 0
    failed: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # kind -> number of runs that raised it
    first_kinds: dict[str, int] = field(default_factory=dict)  # kind -> anomalous runs whose FIRST alert it was

    @property
    def rate(self) -> float:
        """Fraction of runs that were anomalous."""
        return self.anomalous / self.runs if self.runs else 0.0

    def describe(self, param: str) -> str:
        """``param=value: a/n runs anomalous (kinds)[, f failed]``."""
        kinds = sorted(self.kinds, key=lambda k: (-self.kinds[k], k))
        text = f"{param}={format_value(self.value)}: {self.anomalous}/{self.runs} runs anomalous"
        if kinds:
            text += f" ({', '.join(kinds)})"
        if self.failed:
            text += f", {self.failed} failed"
        return text


@dataclass
class ParamRisk:
    """The per-value risk of one swept parameter; ``spread`` = max rate - min rate over its values."""

    param: str
    values: list[ValueRisk]

    @property
    def spread(self) -> float:
        """How much the anomaly rate depends on this parameter (0: not at all, 1: fully)."""
        rates = [v.rate for v in self.values]
        return max(rates) - min(rates) if rates else 0.0

    def lines(self) -> list[str]:
        """One line per value, in value order."""
        return [v.describe(self.param) for v in self.values]

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {"param": self.param, "spread": self.spread, "values": [
            {"value": v.value, "runs": v.runs, "anomalous": v.anomalous, "failed": v.failed, "rate": v.rate,
             "kinds": v.kinds, "text": v.describe(self.param)} for v in self.values]}


def sort_values(values: Iterable[Any]) -> list[Any]:
    """Numbers ascending (None first), then everything else by its text."""
    vals = list(values)
    nums = sorted(v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool))
    rest = sorted((v for v in vals if not (isinstance(v, (int, float)) and not isinstance(v, bool))),
                  key=lambda v: (v is not MISSING, v is not None, str(v)))
    unset = [v for v in rest if v is None or v is MISSING]
    return unset + nums + [v for v in rest if v is not None and v is not MISSING]


def param_risk(runs: list[RunSummary], params: list[str]) -> list[ParamRisk]:
    """Per swept parameter, the risk of each of its values; parameters that matter most first.

    Costs O(runs x params); runs without hyperparameters or without trackdiag are left out, and runs
    without a trackdiag setting from that setting's lines.
    """
    out: list[ParamRisk] = []
    runs = [r for r in runs if r.hparams and r.diagnosed]
    for p in params:
        by_value: dict[str, ValueRisk] = {}
        setting = is_setting(p)
        for r in runs:
            if setting and p not in r.hparams:
                continue
            v = r.hparams.get(p, MISSING)
            vr = by_value.setdefault(repr(v), ValueRisk(value=v))
            vr.runs += 1
            vr.anomalous += r.anomalous
            vr.failed += r.failed
            kinds = r.anomaly_kinds()
            for k in kinds:
                vr.kinds[k] = vr.kinds.get(k, 0) + 1
            if r.anomalous and kinds:
                vr.first_kinds[kinds[0]] = vr.first_kinds.get(kinds[0], 0) + 1
        order = {repr(v): i for i, v in enumerate(sort_values(x.value for x in by_value.values()))}
        if len(by_value) > 1:  # a single value left (the others were runs without trackdiag): nothing to compare
            out.append(ParamRisk(p, sorted(by_value.values(), key=lambda x: order[repr(x.value)])))
    return sorted(out, key=lambda pr: -pr.spread)


def headline(runs: list[RunSummary]) -> str:
    """``12 runs: 3 critical, 1 warning, 7 ok, 1 failed``."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.display_health] = counts.get(r.display_health, 0) + 1
    parts = [f"{counts[h]} {h}" for h in ("critical", "warning", "failed", "unknown", "ok", NO_TRACKDIAG) if counts.get(h)]
    return f"{len(runs)} run{'s' if len(runs) != 1 else ''}: " + ", ".join(parts)


def risk_lines(risks: list[ParamRisk]) -> list[str]:
    """Every parameter's lines, most decisive parameter first."""
    return [line for pr in risks for line in pr.lines()]

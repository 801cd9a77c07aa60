"""The :class:`Record`: the plain, serialisable boundary between probes, rules and sinks."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trackdiag.core.alert import Alert


@dataclass
class Histogram:
    """A binned distribution: ``len(edges) == len(counts) + 1``."""

    edges: list[float]
    counts: list[float]

    def to_dict(self) -> dict[str, Any]:
        return {"edges": self.edges, "counts": self.counts}


@dataclass
class Record:
    """Everything measured at one logging step.

    step: optimizer step the record belongs to.
    scalars: metric key -> value at ``step``.
    series: metric key -> ``[(step, value), ...]`` for values kept every step between logging
        steps (the loss), so curves have full resolution without a host sync per step.
    tables: table name -> {row name -> value}; per-layer values that exceed the metric-key budget.
    histograms: key -> :class:`Histogram`.
    artifacts: files written for this step (paths).
    alerts: alerts raised while judging this record.
    """

    step: int
    scalars: dict[str, float] = field(default_factory=dict)
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    tables: dict[str, dict[str, float]] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    artifacts: list[str] = field(default_factory=list)
    alerts: list[Alert] = field(default_factory=list)
    time: float = 0.0

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "time": self.time,
                "scalars": {k: _num(v) for k, v in self.scalars.items()},
                "series": {k: [[s, _num(v)] for s, v in pts] for k, pts in self.series.items()},
                "tables": {k: {r: _num(v) for r, v in t.items()} for k, t in self.tables.items()},
                "histograms": {k: h.to_dict() for k, h in self.histograms.items()},
                "artifacts": self.artifacts,
                "alerts": [a.to_dict() for a in self.alerts],
            },
            allow_nan=False,
        )

    @classmethod
    def from_json(cls, line: str) -> "Record":
        d = json.loads(line)
        return cls(
            step=d["step"],
            time=d.get("time", 0.0),
            scalars={k: float(v) for k, v in d["scalars"].items()},
            series={k: [(int(s), float(v)) for s, v in pts] for k, pts in d.get("series", {}).items()},
            tables={k: {r: float(v) for r, v in t.items()} for k, t in d.get("tables", {}).items()},
            histograms={k: Histogram(**h) for k, h in d.get("histograms", {}).items()},
            artifacts=list(d.get("artifacts", [])),
            alerts=[Alert.from_dict(a) for a in d.get("alerts", [])],
        )

    def points(self) -> Iterator[tuple[str, int, float]]:
        """Every (key, step, value) metric point this record carries, series included."""
        for k, v in self.scalars.items():
            yield k, self.step, v
        for k, pts in self.series.items():
            for s, v in pts:
                yield k, s, v


def _num(v: float) -> float | str:
    """JSON-safe number: non-finite values become the strings 'nan', 'inf', '-inf'."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def read_records(run_dir: str | Path) -> Iterator[Record]:
    """The records of a local run directory, in order (a torn last line is skipped)."""
    path = Path(run_dir) / "records.jsonl"
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    yield Record.from_json(line)
                except json.JSONDecodeError:
                    continue

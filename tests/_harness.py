"""What the training loops of the suite share: one intra-op thread, a lean session writing the local
record only, and the two questions every fault test asks of a run (its first alert, and when it was raised).

The zoo (``_zoo_*.py``), the style corpus (``_styles/``) and the one-off loops of single tests build on
these; a loop's own code (its model, data and faults) stays in its module, as a user's script would.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

import trackdiag
from trackdiag.core.registry import PROBES

SEVERITY = {"info": 0, "warning": 1, "critical": 2}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """2 shared cores: intra-op threads only contend. Restores the previous setting."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def quiet_probes(**extra: Any) -> dict[str, Any]:
    """Probe overrides for fast tests: the end-of-run report, histograms and landscapes off (they cost
    seconds and judge nothing)."""
    off: dict[str, Any] = {n: {"enabled": False} for n in ("report", "histograms", "landscape") if n in PROBES}
    return {**off, **extra}


def local_session(model: Any, opt: Any, out: Path | str, level: str, **overrides: Any) -> trackdiag.Diagnostics:
    """``Diagnostics`` as the README's quick start builds it, writing the local record only, with
    :func:`quiet_probes` (``probes=`` adds to them)."""
    probes = quiet_probes(**overrides.pop("probes", {}))
    sinks = overrides.pop("sinks", ["local"])
    return trackdiag.Diagnostics(model, opt, level=level, sinks=sinks, output_dir=str(out), probes=probes,
                                 **overrides)


class Judged:
    """A finished run's verdicts; ``self.diag`` is its session, or a framework callback holding one
    (``.alerts``, ``.summary()``)."""

    diag: Any

    @property
    def run_dir(self) -> Path:
        return Path(self.diag.summary()["output_dir"])

    def alerts(self, min_severity: str = "warning") -> list[Any]:
        return [a for a in self.diag.alerts if SEVERITY[a.severity] >= SEVERITY[min_severity]]

    def first(self, min_severity: str = "warning", kinds: set[str] | None = None) -> Any:
        """The earliest alert (by the step it names) at ``min_severity`` or worse, of ``kinds`` if given."""
        found = [a for a in self.alerts(min_severity) if kinds is None or a.kind in kinds]
        return min(found, key=lambda a: a.step) if found else None

    def raised_at(self, alert: Any) -> int:
        """The logging step whose record carried ``alert`` (when the user was told; ``alert.step`` is when
        the fault happened); -1 if none."""
        from trackdiag.core.record import read_records

        for rec in read_records(self.run_dir):
            if any((a.kind, a.step, a.where) == (alert.kind, alert.step, alert.where) for a in rec.alerts):
                return rec.step
        return -1


def styles_report() -> Any:
    """``benchmarks/styles_report.py`` as a module (one instance per process): the corpus judged by the report's own
    code in the tests."""
    import importlib.util
    import sys

    if "styles_report" in sys.modules:
        return sys.modules["styles_report"]
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "styles_report.py"
    spec = importlib.util.spec_from_file_location("styles_report", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["styles_report"] = mod
    spec.loader.exec_module(mod)
    return mod

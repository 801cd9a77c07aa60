"""Pictures of a run, drawn from its records (live or read from disk), one module per picture.

Every function draws on a private ``matplotlib.figure.Figure`` with the Agg canvas: no pyplot, no
global backend switch, safe in a notebook or a background thread. matplotlib is imported inside
the functions (``pip install trackdiag[plots]``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from trackdiag.core.errors import TrackdiagError
from trackdiag.core.record import Record

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 90
#: ``diag/[<component>/]<family>/<what>/<rest>`` -> component, rest
_KEY = re.compile(r"^diag/(?:(?P<comp>[^/]+)/)?(?P<family>grad|param)/(?P<what>norm|hist)/(?P<rest>.+)$")


def figure(width: float = 8.0, height: float = 4.0, layout: str | None = "constrained") -> "Figure":
    """A new Agg-backed figure (raises :class:`TrackdiagError` naming the extra when matplotlib is missing);
    ``layout=None`` for a picture that places its axes itself (constrained layout measures every tick label of
    every axes, twice: most of a many-panel picture's cost)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise TrackdiagError("trackdiag plots need matplotlib: pip install 'trackdiag[plots]'") from exc
    fig = Figure(figsize=(width, height), dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save(fig: "Figure", path: str | Path) -> Path:
    """Write ``fig`` as a PNG and return the path (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=DPI)
    return path


def split_key(key: str, family: str, what: str) -> tuple[str, str] | None:
    """``(component, rest)`` when ``key`` is ``diag/[<c>/]<family>/<what>/<rest>``, else None."""
    m = _KEY.match(key)
    if m is None or m["family"] != family or m["what"] != what:
        return None
    return m["comp"] or "", m["rest"]


def loss_points(records: Iterable[Record]) -> dict[str, list[tuple[int, float]]]:
    """Every loss curve of the run (``diag/loss``, ``diag/<c>/loss``, ``diag/eval/loss``) as (step, value)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, pts in r.series.items():
            if k == "diag/loss" or k.endswith("/loss"):
                out.setdefault(k, []).extend(pts)
        for k, v in r.scalars.items():
            if k == "diag/eval/loss":
                out.setdefault(k, []).append((r.step, v))
    return {k: sorted(v) for k, v in out.items()}


def scalar_series(records: Iterable[Record], prefix: str) -> dict[str, list[tuple[int, float]]]:
    """Scalars whose key starts with ``prefix``, as ``key -> [(step, value), ...]``."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for k, v in r.scalars.items():
            if k.startswith(prefix):
                out.setdefault(k, []).append((r.step, v))
    return out


def describe(obj: Any) -> str:
    """Short text of a value for tables (shapes, numbers)."""
    if isinstance(obj, float):
        return f"{obj:.4g}"
    return str(obj)

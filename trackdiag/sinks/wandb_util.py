"""Helpers of the W&B sink that need no ``wandb`` import: secret redaction (the shared
:mod:`trackdiag.util.redact` policy), summary policies, sweep group names, histogram fitting, credential
checks, alert levels and the alert series' shape (:class:`AlertSteps`)."""
from __future__ import annotations

import hashlib
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from trackdiag.core.errors import TrackdiagError
from trackdiag.util.redact import DEFAULT_POLICY, MASK, RedactPolicy

#: Extra key words the W&B sink hides on top of the shared policy (its ``redact`` option); none by
#: default: the run's hyperparameters reach the sink already redacted by :class:`~trackdiag.core.runinfo.RunInfo`.
SECRET_WORDS: tuple[str, ...] = ()
REDACTED = MASK
#: trackdiag severity -> ``wandb.AlertLevel`` value.
ALERT_LEVELS: dict[str, str] = {"info": "INFO", "warning": "WARN", "critical": "ERROR"}
SEVERITY_RANK: dict[str, int] = {"info": 0, "warning": 1, "critical": 2}
MODES = ("online", "offline", "disabled", "shared")
MAX_BINS = 512  # wandb.Histogram.MAX_LENGTH
MAX_GROUP = 128  # W&B rejects longer group names
ALERT_PREFIX = "diag/alerts/"
Point = tuple[int, str, int]  # (training step, key, running count)


def redact(obj: Any, words: Sequence[str] = SECRET_WORDS, policy: RedactPolicy = DEFAULT_POLICY) -> Any:
    """A copy of ``obj`` (dicts, lists, scalars) with ``policy`` applied, plus every value under a
    key containing one of ``words`` (case-insensitive substrings) replaced by :data:`REDACTED`."""
    if words:
        policy = policy.extended(re.escape(str(w)) for w in words)
    return policy.redact(obj)


def summary_policy(key: str) -> str | None:
    """The summary aggregation for a metric key: best-ever loss, worst-ever gradient norm.

    ``min,last`` for losses (``diag/loss``, ``diag/eval/loss``, ``diag/<c>/loss``, not the EMA or
    counters below them); ``max,last`` for gradient norms; None (W&B's default, last) otherwise.
    """
    leaf = key.rsplit("/", 1)[-1]
    if leaf == "loss" or key.endswith("/loss/ema"):
        return "min,last"
    if "/grad/" in key and (leaf.endswith("global_norm") or leaf == "norm" or "/grad/norm/" in key):
        return "max,last"
    return None


def sweep_group(sweep_dir: str) -> str:
    """A short, stable W&B group for a Hydra sweep dir: its last two parts plus a path hash.

    ``/x/multirun/2026-01-02/10-11-12`` -> ``2026-01-02/10-11-12-3f2a1c``; two sweeps started in the
    same second in different directories stay apart.
    """
    parts = Path(sweep_dir).parts
    digest = hashlib.sha1(sweep_dir.encode("utf-8")).hexdigest()[:6]
    return f"{'/'.join(parts[-2:])}-{digest}"[-MAX_GROUP:]


def fit_histogram(edges: Sequence[float], counts: Sequence[float]) -> tuple[list[float], list[float]] | None:
    """``(counts, edges)`` for ``wandb.Histogram(np_histogram=...)``: at most 512 bins (adjacent bins
    merged), non-finite edges dropped with their bins. None when nothing is left to draw."""
    pairs = [(float(edges[i]), float(edges[i + 1]), float(c)) for i, c in enumerate(counts)
             if i + 1 < len(edges) and math.isfinite(float(edges[i])) and math.isfinite(float(edges[i + 1]))]
    if not pairs:
        return None
    while len(pairs) > MAX_BINS:
        pairs = [(a[0], b[1] if b else a[1], a[2] + (b[2] if b else 0.0))
                 for a, b in zip(pairs[::2], [*pairs[1::2], None])]
    return [c for _, _, c in pairs], [pairs[0][0], *(hi for _, hi, _ in pairs)]


def resolve_mode(mode: str | None) -> str:
    """``mode``, else ``$WANDB_MODE``, else ``online``; ``dryrun`` is W&B's old name for offline."""
    m = (mode or os.environ.get("WANDB_MODE") or "online").lower()
    m = "offline" if m == "dryrun" else m
    if m not in MODES:
        raise TrackdiagError(f"diag.sink.wandb.mode: {m!r} is not one of {', '.join(MODES)}")
    return m


def check_credentials(settings: Mapping[str, Any]) -> None:
    """Raise if an online run has no API key anywhere, instead of letting ``wandb.init`` prompt for
    one on the sink thread. Looks at ``settings.api_key``, ``WANDB_API_KEY``,
    ``WANDB_IDENTITY_TOKEN_FILE`` and ``~/.netrc``; when the netrc check itself fails, W&B decides."""
    if settings.get("api_key") or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return
    host = str(settings.get("base_url") or os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        found = read_netrc_auth(host=host)
    except Exception:  # internal API moved or netrc unreadable: let wandb handle login itself
        return
    if not found:
        raise TrackdiagError(
            f"W&B online mode needs an API key for {host} and none is configured: run `wandb login`, "
            "set WANDB_API_KEY, or log offline with diag.sink.wandb.mode=offline (WANDB_MODE=offline)")


class AlertSteps:
    """``diag/alerts/<kind>`` running counts as step-shaped series over the run's steps, as the MLflow
    sink draws them, so a W&B chart of a kind spans the loss's x range on ``diag/step``.

    A count logged only at each alert's step is a chart that starts at the kind's first alert and
    cannot be read against the loss. The points: 0 at the run's first step, the previous count one
    step before each alert (W&B draws straight lines between points: without it a count seems to ramp
    up over the steps before an alert), the new count at the alert's step, and the final count at the
    run's last step (:meth:`closing`). Cost: O(1) per step seen, at most 3 points per alert.
    """

    def __init__(self) -> None:
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.counts: dict[str, int] = {}
        self._last: dict[str, int] = {}  # kind -> step of its latest point

    def saw(self, step: int) -> None:
        """Widen the run's step range by one metric point's step."""
        self.first_step = step if self.first_step is None else min(self.first_step, step)
        self.last_step = step if self.last_step is None else max(self.last_step, step)

    def add(self, kind: str, step: int) -> list[Point]:
        """Count one alert of ``kind`` at ``step``; returns the points to log."""
        key, before = f"{ALERT_PREFIX}{kind}", self.counts.get(kind, 0)
        self.counts[kind] = before + 1
        points: list[Point] = []
        last = self._last.get(kind)
        if last is None and self.first_step is not None and step > self.first_step:
            points.append((self.first_step, key, 0))  # the series starts where the loss does
            last = self.first_step
        if last is not None and step - 1 > last:
            points.append((step - 1, key, before))  # flat until the alert's step
        points.append((step, key, before + 1))
        self._last[kind] = max(step, last if last is not None else step)
        return points

    def closing(self) -> list[Point]:
        """Every kind's final count at the run's last step (where the loss ends)."""
        if self.last_step is None:
            return []
        return [(self.last_step, f"{ALERT_PREFIX}{kind}", n) for kind, n in self.counts.items()
                if self.last_step > self._last.get(kind, self.last_step)]

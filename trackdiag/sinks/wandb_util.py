"""Helpers of the W&B sink that need no ``wandb`` import: secret redaction (the shared
:mod:`trackdiag.util.redact` policy), summary policies, sweep group names, histogram fitting, credential
checks and alert levels."""
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

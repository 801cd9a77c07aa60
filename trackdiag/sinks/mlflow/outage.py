"""What a failed MLflow call means for the deliverer: reject the op, stop for good, or back off.

Mixin for :class:`~trackdiag.sinks.mlflow.deliver.Deliverer` (uses its lock, spool and state).
An op MLflow refuses for good (a bad value, a missing file) is kept in ``rejected.jsonl`` with the
reason (the first three are logged); a run that cannot be set up stops delivery (everything stays
spooled for ``trackdiag sync``); anything else is an outage: one warning per outage, exponential
backoff between ``backoff`` and ``max_backoff`` seconds.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from trackdiag.sinks.mlflow.ops import is_permanent
from trackdiag.sinks.mlflow.run import NoRun
from trackdiag.sinks.mlflow.spool import Spool
from trackdiag.sinks.mlflow.store import healthy

log = logging.getLogger("trackdiag")


class Outages:
    """Failure classification and backoff state (see the module doc)."""

    _cv: threading.Condition
    _stop: bool
    _broken: str | None
    _health: str | None
    _down_since: float | None
    _delay: float
    _retry_at: float
    _attempts: int
    _rejected: int
    backoff: float
    max_backoff: float
    max_attempts: int
    spool: Spool
    state: dict[str, Any]

    def _reject(self, op: dict[str, Any], exc: BaseException | str) -> None:
        self._rejected += 1
        with self._cv:
            self.spool.reject(op, exc)
        if self._rejected <= 3:
            why = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
            log.warning("trackdiag: MLflow rejected a %r op (%s); kept in %s/rejected.jsonl",
                        op.get("op"), why[:300], self.spool.dir)

    def _classify(self, ops: list[dict[str, Any]], exc: BaseException) -> str:
        """``reject`` (MLflow refuses it for good), ``broken`` (no run: stop) or ``retry`` (outage: back off)."""
        if self._stop:  # closed meanwhile: close() spooled the ops; nothing more to say
            return "retry"
        name = ops[0].get("op")
        if isinstance(exc, NoRun) or (name in ("open", "connect") and is_permanent(exc)):
            with self._cv:
                self._broken = f"{type(exc).__name__}: {exc}"
            log.warning("trackdiag: MLflow run set-up failed (%s); records stay spooled in %s, fix it and run "
                        "`trackdiag sync %s`", self._broken, self.spool.dir, self.spool.dir.parent)
            return "broken"
        if name not in ("health", "connect", "?"):
            self._attempts += 1
            if is_permanent(exc) or (self._attempts >= self.max_attempts and healthy(self._health)):
                self._attempts = 0
                return "reject"
        with self._cv:
            if self._down_since is None:
                self._down_since = time.monotonic()
                log.warning("trackdiag: MLflow at %s unreachable (%s: %s). Training continues; diagnostics are "
                            "spooled in %s and retried with backoff (one warning per outage)",
                            self.state["tracking_uri"], type(exc).__name__, str(exc)[:200], self.spool.dir)
            self._delay = min(max(self._delay * 2, self.backoff), self.max_backoff)
            self._retry_at = time.monotonic() + self._delay
            self._cv.notify_all()
        return "retry"

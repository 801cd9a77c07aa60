"""Exceptions raised by trackdiag. Every one derives from :class:`TrackdiagError`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from trackdiag.core.alert import Alert


class TrackdiagError(Exception):
    """Root of every exception trackdiag raises on purpose."""


class ConfigError(TrackdiagError, ValueError):
    """The diagnostics configuration is invalid. ``problems`` lists every problem found."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid trackdiag config ({len(self.problems)} problem(s)):\n{lines}")


class AlertRaised(TrackdiagError):
    """Raised by a rule whose action is ``raise``; ``alert`` holds what tripped."""

    def __init__(self, alert: "Alert") -> None:
        self.alert = alert
        super().__init__(alert.describe())


def brief(exc: BaseException, limit: int = 240) -> str:
    """``"TypeName: first line of the message"``, cut to ``limit`` characters: what a console line may
    carry of an exception (a PyTorch dispatcher error is ~100 lines; the full text goes to the record)."""
    text = str(exc).strip()
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) > limit:
        line = line[: limit - 3].rstrip() + "..."
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__

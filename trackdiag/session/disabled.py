"""The no-op session ``from_config`` returns when the Hydra config has no ``diag`` entry."""
from __future__ import annotations

from typing import Any

from trackdiag.core.alert import Alert


class DisabledDiagnostics:
    """Same methods as :class:`~trackdiag.Diagnostics`; registers no hook and does nothing."""

    enabled = False
    should_stop = False
    loss_fn = None  # settable, unused (see Diagnostics.loss_fn)

    def __enter__(self) -> "DisabledDiagnostics":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    @property
    def alerts(self) -> list[Alert]:
        return []

    def step(self, loss: Any = None, *, outputs: Any = None, batch: Any = None, batch_size: int | None = None) -> bool:
        return False

    def log_eval(self, loss: Any = None, **metrics: Any) -> None:
        """Checks the values like the live session (odd ones: one warning), reads nothing back."""
        from trackdiag.util.eval_values import eval_scalars

        eval_scalars(loss, metrics, convert=False)

    def summary(self) -> dict[str, Any]:
        return {"enabled": False, "steps": 0, "alerts": {}, "health": "ok"}

    def wrap_loader(self, loader: Any) -> Any:
        return loader

    def preflight(self, batch: Any, loss_fn: Any = None, **kw: Any) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self, status: str | None = None, timeout: float | None = None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

"""What probes see of the session: the components, the step, the schedule."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from trackdiag.layers import LayerIndex


@dataclass
class Component:
    """One named model with the optimizer that steps it (``name == ""`` for a single model)."""

    name: str
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    index: LayerIndex

    def key(self, suffix: str) -> str:
        """The metric key of ``suffix`` for this component: ``diag/[<name>/]<suffix>``."""
        return f"diag/{self.name}/{suffix}" if self.name else f"diag/{suffix}"


@dataclass
class StepInputs:
    """What the user passed to ``Diagnostics.step``; losses and outputs keyed by component."""

    losses: Mapping[str, Any]
    outputs: Any = None
    batch: Any = None
    batch_size: int | None = None


@dataclass
class ProbeContext:
    """Shared, mutable view of the session the probes read. ``step`` is the optimizer step in
    progress; ``is_due(schedule)`` answers whether a schedule fires at it (anomaly windows included)."""

    components: list[Component]
    every: int
    layer_budget: int
    scaler: Any = None
    output_dir: Path | None = None
    step: int = 0
    anomaly_until: int = -1
    extra: dict[str, Any] = field(default_factory=dict)
    #: seconds spent in trackdiag's forward/backward hooks since the last logging step (they run inside
    #: the user's forward/backward, so the session's own clock does not see them)
    hook_seconds: float = 0.0

    def is_due(self, schedule: Callable[[int], bool]) -> bool:
        return schedule(self.step) or (self.step <= self.anomaly_until and getattr(schedule, "anomaly", True))

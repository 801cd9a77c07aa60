"""Loss landscape probe: a filter-normalised loss landscape of the model, on a sparse schedule.

On each due step it takes the step's batch (``diag.step(..., batch=...)``) and evaluates, along one
or two random directions (see :mod:`trackdiag.forensics.landscape`), the user's own loss computation
``loss_fn(batch)`` when the session has one (``Diagnostics(..., loss_fn=...)``: models that return
their loss, take several inputs, or several models), else ``model(x)`` scored against ``y`` with
``loss`` (``cross_entropy`` | ``mse``) for a batch ``(x, y)``; a batch it cannot interpret is skipped
with one console note per session saying how to enable it. It writes ``landscape/step_<N>.png`` and ``.json``
into the run's output dir. Emits ``diag/[<c>/]landscape/center_loss`` and
``diag/[<c>/]landscape/max_rise`` (largest loss rise over the grid: a sharpness proxy) and adds the
two files to ``record.artifacts``. Weights, buffers and train/eval flags are restored bit for bit.
Cost per due step: ``steps`` (1-D) or ``steps**2`` (2-D) forward passes, capped by ``max_evals``,
plus ~0.3 s of plotting; three copies of the parameters in extra memory while it runs. Only rank 0
runs it under ``torch.distributed``. Nothing on other steps beyond keeping a reference to the batch.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.capture.user_loss import loss_value, skipped
from trackdiag.core.errors import ConfigError, brief
from trackdiag.core.record import Record
from trackdiag.forensics.landscape import LOSSES
from trackdiag.probes.base import Probe

log = logging.getLogger("trackdiag")


def is_rank_zero() -> bool:
    """True outside ``torch.distributed`` and on its rank 0."""
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class LandscapeProbe(Probe):
    """See module docstring.

    Args:
        every: cadence in optimizer steps (keep it sparse: hundreds or thousands).
        loss: ``cross_entropy`` | ``mse``, applied as ``loss(model(x), y)``.
        dims: 1 (a slice) or 2 (a contour); steps: grid points per axis (rounded down to odd);
        span: the grid covers ``[-span, span]`` filter-normalised units; max_evals: cap on forwards;
        seed: seed of the random directions (the same directions at every due step).
    """

    name = "landscape"

    def __init__(self, *, enabled: bool = True, every: int | None = 1000, loss: str = "cross_entropy", dims: int = 2,
                 steps: int = 11, span: float = 1.0, max_evals: int = 121, seed: int = 0) -> None:
        super().__init__(enabled=enabled, every=every)
        problems = []
        if loss not in LOSSES:
            problems.append(f"diag.probes.landscape.loss: {loss!r} is not one of {', '.join(LOSSES)}")
        if dims not in (1, 2):
            problems.append(f"diag.probes.landscape.dims: must be 1 or 2, got {dims!r}")
        if steps < 3 or max_evals < 3:
            problems.append(f"diag.probes.landscape.steps/max_evals: must be >= 3, got {steps!r}/{max_evals!r}")
        if not span > 0:
            problems.append(f"diag.probes.landscape.span: must be > 0, got {span!r}")
        if problems:
            raise ConfigError(problems)
        self.loss, self.dims, self.steps, self.span = loss, dims, steps, float(span)
        self.max_evals, self.seed = max_evals, seed
        self._results: dict[str, tuple[float, float, list[str]]] = {}
        self._skip = False

    def attach(self, ctx: ProbeContext) -> None:
        """Import matplotlib now, at the session's start: imported mid-training, a Ctrl-C landing
        inside the import (a notebook interrupted and resumed) left it half-initialised for the
        whole process (``module 'matplotlib' has no attribute ...``, the user's own plots included)."""
        try:
            import matplotlib.backends.backend_agg  # noqa: F401
            import matplotlib.figure  # noqa: F401
        except ImportError:
            pass  # said when a landscape is drawn

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if not self.schedule(ctx.step) or (self._skip and ctx.loss_fn is None):  # plain schedule: not anomaly windows
            return
        if ctx.output_dir is None or not is_rank_zero():
            return
        batch, user = inputs.batch, ctx.loss_fn
        if batch is None or (user is None and (not isinstance(batch, (list, tuple)) or len(batch) < 2)):
            skipped(ctx, self.name, "no batch was given to step()" if batch is None else
                    f"the batch is a {type(batch).__name__}, not (inputs, targets)")
            return
        from trackdiag.capture.forward_watch import FORWARD
        from trackdiag.forensics.landscape import loss_landscape
        from trackdiag.plots.landscape import save_landscape, sharpness

        evaluate = (lambda: loss_value(user(batch))) if user is not None else None
        for comp in ctx.components:
            if comp.model is None:
                continue
            try:
                with FORWARD.paused():
                    result = loss_landscape(comp.model, batch, self.loss, dims=self.dims, steps=self.steps,
                                            span=self.span, max_evals=self.max_evals, seed=self.seed, evaluate=evaluate)
            except Exception as exc:  # noqa: BLE001 - a guessed call that does not fit this model
                if user is not None:
                    raise  # the user's own loss failed: the probe is switched off with one line
                skipped(ctx, self.name, f"model(batch[0]) scored against batch[1] raised {brief(exc)}")
                self._skip = True  # the same call fails at every due step
                return
            result.directions = []  # free the memory now
            stem = f"step_{ctx.step:07d}" + (f"_{comp.name}" if comp.name else "")
            png, js = save_landscape(result, Path(ctx.output_dir) / "landscape", stem)
            self._results[comp.name] = (result.center_loss, sharpness(result), [str(png), str(js)])
            log.info("trackdiag: loss landscape at step %d: %d evals in %.2fs -> %s", ctx.step, result.evals,
                     result.seconds, png)

    def collect(self, ctx: ProbeContext) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (center, rise, _) in self._results.items():
            out[f"{name}|center"], out[f"{name}|rise"] = center, rise
        return out

    def publish(self, ctx: ProbeContext, values: dict[str, np.ndarray], record: Record) -> None:
        for comp in ctx.components:
            got = self._results.pop(comp.name, None)
            if got is None:
                continue
            record.scalars[comp.key("landscape/center_loss")] = float(values[f"{comp.name}|center"][0])
            record.scalars[comp.key("landscape/max_rise")] = float(values[f"{comp.name}|rise"][0])
            record.artifacts.extend(got[2])

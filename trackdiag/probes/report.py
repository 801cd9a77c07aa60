"""Report probe: the run's pictures and its HTML report, written at the end of the run.

At the first step (with ``summary``): ``environment.json`` (versions, devices, seeds) and
``model_summary.json`` (parameters per module, FLOPs per step, shapes of that step's batch), in the
run's output dir. Optionally (``memory_snapshot_steps > 0``, models on CUDA only) a CUDA allocator
history of the first steps as ``memory_snapshot.pickle`` (open it in https://pytorch.org/memory_viz).
At the end (``finish``, from the complete local record): ``plots/loss_alerts.png``,
``plots/grad_flow.png``, ``plots/grad_hist.png``, ``plots/param_hist.png``, ``plots/memory.png`` (those
the logged data allow) and ``report.html`` (self-contained); every file's path goes to
``record.artifacts`` of the final record, with ``diag/[<c>/]model/params_total``,
``params_trainable`` and ``flops_per_step`` as scalars.
Cost: one eval-mode forward of one batch at the first step (model summary); at the end, reading
the records and ~0.2-0.5 s per figure. It never triggers a logging step itself.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trackdiag.capture.context import ProbeContext, StepInputs
from trackdiag.core.errors import ConfigError
from trackdiag.core.record import Record
from trackdiag.probes.base import Probe
from trackdiag.util.schedule import Never

log = logging.getLogger("trackdiag")


class ReportProbe(Probe):
    """See module docstring.

    Args:
        html: write ``report.html`` (the pictures are written either way).
        summary: write the environment report and the model summary at the first step.
        memory_snapshot_steps: record the CUDA allocator history for this many first steps (0: off).
    """

    name = "report"

    def __init__(self, *, enabled: bool = True, every: int | None = None, html: bool = True, summary: bool = True,
                 memory_snapshot_steps: int = 0) -> None:
        super().__init__(enabled=enabled, every=every)
        if memory_snapshot_steps < 0:
            raise ConfigError([f"diag.probes.report.memory_snapshot_steps: must be >= 0, got {memory_snapshot_steps!r}"])
        self.html, self.summary, self.snapshot_steps = html, summary, memory_snapshot_steps
        self.schedule = Never()
        self._files: list[Path] = []
        self._summaries: dict[str, dict[str, Any]] = {}
        self._snapshot: Any = None
        self._started = False

    def bind(self, default_every: int) -> None:
        """Nothing to schedule: the report is written at the end."""
        self.schedule = Never()

    def attach(self, ctx: ProbeContext) -> None:
        """Start the CUDA allocator history now, so the first step's allocations are in it."""
        if self.snapshot_steps and any(p.is_cuda for c in ctx.components for p in c.index.params[:1]):
            from trackdiag.plots.memory import MemorySnapshot

            snap = MemorySnapshot(None, steps=self.snapshot_steps)
            self._snapshot = snap if snap.start() else None

    def on_step(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        if self._snapshot is not None:
            if self._snapshot.path is None and ctx.output_dir is not None:
                self._snapshot.path = Path(ctx.output_dir) / "memory_snapshot.pickle"
            self._snapshot.step()
        if self._started or ctx.output_dir is None:
            return
        self._started = True
        if self.summary:
            self._write_summaries(ctx, inputs)

    def _write_summaries(self, ctx: ProbeContext, inputs: StepInputs) -> None:
        from trackdiag.plots.environment import environment_report
        from trackdiag.plots.summary import model_summary

        out = Path(ctx.output_dir)  # type: ignore[arg-type]
        out.mkdir(parents=True, exist_ok=True)
        env = out / "environment.json"
        env.write_text(json.dumps(environment_report(), indent=1, default=str), encoding="utf-8")
        self._files.append(env)
        for comp in ctx.components:
            if comp.model is not None:
                self._summaries[comp.name] = model_summary(comp.model, inputs.batch)
        if self._summaries:
            path = out / "model_summary.json"
            body = self._summaries.get("") if list(self._summaries) == [""] else self._summaries
            path.write_text(json.dumps(body, indent=1, default=str), encoding="utf-8")
            self._files.append(path)

    def finish(self, ctx: ProbeContext, record: Record) -> None:
        if ctx.output_dir is None:
            return
        if self._snapshot is not None and self._snapshot.stop() is not None:
            self._files.append(self._snapshot.written)
        from trackdiag.plots.report import build_report

        files = [*self._files, *build_report(ctx.output_dir, write_html=self.html)]
        record.artifacts.extend(str(Path(f).resolve()) for f in dict.fromkeys(files))
        for comp in ctx.components:
            s = self._summaries.get(comp.name)
            if s is None:
                continue
            for k in ("params_total", "params_trainable", "flops_per_step"):
                if s.get(k) is not None:
                    record.scalars[comp.key(f"model/{k}")] = float(s[k])

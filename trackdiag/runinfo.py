"""Where a run's outputs go and what it is called, with or without Hydra."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunInfo:
    """What sinks learn when a run opens.

    name: run name (Hydra job name + override dir name by default).
    output_dir: the local record's directory (always written).
    level: the preset in force. config: the resolved diagnostics config.
    hparams: the user's hyperparameters (their whole Hydra config, usually), as plain containers.
    original_cwd: the directory the user started from (Hydra may have changed it).
    group: the sweep a Hydra multirun job belongs to (its sweep dir), else None.
    """

    name: str
    output_dir: Path
    level: str
    config: dict[str, Any]
    hparams: dict[str, Any] = field(default_factory=dict)
    original_cwd: Path = field(default_factory=Path.cwd)
    group: str | None = None
    job_num: int | None = None
    start_time: float = field(default_factory=time.time)
    components: list[str] = field(default_factory=list)


def hydra_runtime() -> dict[str, Any] | None:
    """Output dir, job name, sweep dir and original cwd of the running Hydra job, or None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            return None
        hc = HydraConfig.get()
    except Exception:  # hydra not installed or not running
        return None
    mode = str(getattr(hc, "mode", ""))
    multirun = mode.endswith("MULTIRUN")
    return {
        "output_dir": Path(hc.runtime.output_dir),
        "cwd": Path(hc.runtime.cwd),
        "job_name": hc.job.name,
        "overrides": [o for o in hc.overrides.task if not o.lstrip("+~").startswith(("diag", "hydra"))],
        "sweep_dir": str(Path(hc.sweep.dir).resolve()) if multirun else None,
        "job_num": int(hc.job.num) if multirun and hc.job.get("num") is not None else None,
    }


def resolve_run(output_dir: str | None, run_name: str | None) -> tuple[str, Path, Path, str | None, int | None]:
    """(name, output dir, original cwd, sweep group, job number) for a new run.

    Default output dir: ``<hydra job output dir>/diag`` under Hydra, else
    ``./trackdiag_runs/<name>`` (relative paths resolve against the original working dir).
    """
    hydra = hydra_runtime()
    cwd = hydra["cwd"] if hydra else Path.cwd()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if hydra:
        # the job name plus the user's own overrides (diag.* and hydra.* left out), like Hydra's override_dirname
        name = run_name or "-".join(x for x in (hydra["job_name"], ",".join(hydra["overrides"])) if x)[:120]
        if hydra["job_num"] is not None and not run_name:
            name = f"{name}#{hydra['job_num']}"
        default_dir = hydra["output_dir"] / "diag"
    else:
        name = run_name or f"run-{stamp}-{os.getpid()}"
        default_dir = cwd / "trackdiag_runs" / name
    out = Path(output_dir) if output_dir else default_dir
    if not out.is_absolute():
        out = cwd / out
    return name, out, cwd, hydra["sweep_dir"] if hydra else None, hydra["job_num"] if hydra else None

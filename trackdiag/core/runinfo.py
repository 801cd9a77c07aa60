"""Where a run's outputs go and what it is called, with or without Hydra.

A :class:`RunInfo` is where the run's hyperparameters, diag config and name enter the session:
it sanitises them (:mod:`trackdiag.util.sanitize`) and applies the redaction policy
(:mod:`trackdiag.util.redact`) once, so every sink (local record, console, MLflow, W&B) gets the same
safe data. A run name is always one safe path component, and an output dir that cannot be
written is replaced by a temporary one (one warning saying where).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from trackdiag.util.redact import DEFAULT_POLICY, MASK, RedactPolicy
from trackdiag.util.sanitize import sanitize

log = logging.getLogger("trackdiag")
MAX_NAME_BYTES = 120
_UNSAFE = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]')


@dataclass
class RunInfo:
    """What sinks learn when a run opens.

    name: run name (Hydra job name + override dir name by default).
    output_dir: the local record's directory (always written).
    level: the preset in force. config: the resolved diagnostics config.
    hparams: the user's hyperparameters (their whole Hydra config, usually), as plain containers.
    original_cwd: the directory the user started from (Hydra may have changed it).
    group: the sweep a Hydra multirun job belongs to (its sweep dir), else None.
    notes: what sanitising changed (unresolvable interpolations, cycles, odd keys), for run.json.

    On creation ``hparams`` and ``config`` are replaced by sanitised, redacted copies (the
    caller's objects are not touched: sinks built from the real config still connect with the
    real credentials) and ``name`` by its redacted, path-safe form. Logs one warning when
    sanitising changed anything.
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
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        policy = RedactPolicy.from_config(self.config.get("redact") if isinstance(self.config, Mapping) else None)
        raw = self.hparams if isinstance(self.hparams, Mapping) or self.hparams is None else {"hparams": self.hparams}
        hparams, notes = sanitize(raw or {})
        config, config_notes = sanitize(self.config or {})
        self.hparams = policy.redact(hparams)
        self.config = policy.redact(config)
        self.name = safe_component(policy.text(str(self.name)))
        self.notes = [*self.notes, *(f"hparams {n}" for n in notes), *(f"diag config {n}" for n in config_notes)]
        if self.notes:
            more = f" (+{len(self.notes) - 5} more in run.json)" if len(self.notes) > 5 else ""
            log.warning("trackdiag: hyperparameters sanitised for logging: %s%s", "; ".join(self.notes[:5]), more)


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


def safe_component(name: str) -> str:
    """``name`` as one safe file name: no path separators, control or reserved characters, no
    leading dot (``..``, hidden files), not empty, at most 120 UTF-8 bytes (a hash keeps long
    names apart). ``../../x`` -> ``___.._x``, ``/etc/passwd`` -> ``_etc_passwd``; a redaction mask
    reads ``redacted``."""
    text = _UNSAFE.sub("_", name.replace(MASK, "redacted")).strip()
    text = re.sub(r"^\.+", lambda m: "_" * len(m.group()), text) or "run"
    raw = text.encode("utf-8")
    if len(raw) > MAX_NAME_BYTES:
        digest = hashlib.sha1(raw).hexdigest()[:8]
        text = raw[: MAX_NAME_BYTES - 9].decode("utf-8", "ignore") + "-" + digest
    return text


def redact_override(override: str, policy: RedactPolicy = DEFAULT_POLICY) -> str:
    """A Hydra override with its value masked when its key is secret (``db.password=x`` -> ``db.password=***``)."""
    key, sep, value = override.partition("=")
    path = key.lstrip("+~").split(".")
    if sep and value and policy.secret_key(path[-1], path):
        return f"{key}={MASK}"
    return policy.text(override)


def writable_dir(path: Path) -> str | None:
    """None if ``path`` can be created/written as a directory, else why not (no side effects)."""
    p = path
    try:
        while not p.exists() and p != p.parent:
            p = p.parent
        if not p.is_dir():
            return f"{p} is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"no write permission on {p}"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def fallback_dir(name: str, wanted: Path, why: str) -> Path:
    """A fresh temporary directory for a run whose output dir cannot be written; warns once, saying where."""
    out = Path(tempfile.mkdtemp(prefix=f"trackdiag-{safe_component(name)[:40]}-"))
    log.warning("trackdiag: cannot write the run's output dir %s (%s); writing to %s instead", wanted, why, out)
    return out


def resolve_run(output_dir: str | None, run_name: str | None) -> tuple[str, Path, Path, str | None, int | None]:
    """(name, output dir, original cwd, sweep group, job number) for a new run.

    Default output dir: ``<hydra job output dir>/diag`` under Hydra, else
    ``./trackdiag_runs/<name>`` (relative paths resolve against the original working dir).
    The name is one safe path component (:func:`safe_component`; Hydra overrides of secret keys
    masked). On the main process, an output dir that cannot be written becomes a temporary dir
    (:func:`fallback_dir`).
    """
    hydra = hydra_runtime()
    cwd = hydra["cwd"] if hydra else Path.cwd()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if hydra:
        # the job name plus the user's own overrides (diag.* and hydra.* left out), like Hydra's override_dirname
        overrides = ",".join(redact_override(o) for o in hydra["overrides"])
        name = run_name or "-".join(x for x in (hydra["job_name"], overrides) if x)[:120]
        if hydra["job_num"] is not None and not run_name:
            name = f"{name}#{hydra['job_num']}"
    else:
        name = run_name or f"run-{stamp}-{os.getpid()}"
    name = safe_component(DEFAULT_POLICY.text(name))
    out = Path(output_dir) if output_dir else (hydra["output_dir"] / "diag" if hydra else cwd / "trackdiag_runs" / name)
    if not out.is_absolute():
        out = cwd / out
    why = writable_dir(out)
    if why is not None and _is_main():
        out = fallback_dir(name, out, why)
    return name, out, cwd, hydra["sweep_dir"] if hydra else None, hydra["job_num"] if hydra else None


def _is_main() -> bool:
    from trackdiag.util.ranks import is_main_process

    return is_main_process()

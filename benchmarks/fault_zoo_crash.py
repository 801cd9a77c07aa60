"""The flight recorder's and the NaN culprit's rows of the README's detection table: each fault of
issues 27 (#6, #7) and 30 planted in loops of several styles (tests/_zoo_crash.py, _zoo_styles.py),
at one preset, logging every 10 steps, onset at step 43 (between two logging steps). A cell: the first alert of warning or worse,
its ``where``, and steps from the onset to the step the alert names / to the logging step (or the
crash) that raised it; for a ``crash`` finding, the evidence it leads with (what the session held or saw
before the crash: :mod:`trackdiag.forensics.crash_evidence`), "–" when none.

Usage: python benchmarks/fault_zoo_crash.py [--level advanced] [--markdown]
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's trackdiag, and the loops

import _zoo_crash as crash  # noqa: E402
import _zoo_styles as styles  # noqa: E402
import trackdiag  # noqa: E402
from trackdiag.core.record import read_records  # noqa: E402

ONSET = 43  # not a logging step: the "raised" column shows the wait for the next one (50)
FLAGS = {"flight": {"modules": True}}
CASES: list[tuple[str, str, Callable[..., Any], dict[str, Any]]] = [
    ("NaN forward, then the loss raises", "vae", crash.vae, {"onset": ONSET}),
    ("NaN forward, then Categorical raises", "rl", crash.rl, {"onset": ONSET}),
    ("LR x1000 between logging steps, the next forward overflows, BCE raises", "vae", crash.vae,
     {"lr": 1e-2, "lr_jump_at": ONSET}),
    ("LR x1000 at an update-ratio step (50), the next forward overflows", "vae", crash.vae, {"lr": 1e-2, "lr_jump_at": 50}),
    ("unrelated RuntimeError", "rl", crash.rl, {"raise_at": ONSET}),
    ("NaN once (transient), flags on", "mlp", crash.mlp, {"transient_at": ONSET, "probes": FLAGS}),
    ("NaN once (transient), flags on", "gru", crash.gru, {"transient_at": ONSET, "probes": FLAGS}),
    ("NaN once (transient), flags off", "mlp", crash.mlp, {"transient_at": ONSET}),
    ("NaN in a layer called as .forward()", "dotforward", crash.dotforward, {"onset": ONSET}),
    ("NaN in a loop-driven .forward() cell, loss_fn", "cellloop", crash.cellloop, {"onset": ONSET, "user_loss": True}),
    ("NaN in a loop-driven .forward() cell, flags on", "cellloop", crash.cellloop, {"onset": ONSET, "probes": FLAGS}),
    ("NaN forward, sparse bags + SparseAdam", "recsys", styles.recsys, {"onset": ONSET}),
    ("NaN backward, sparse bags + SGD", "recsys", styles.recsys, {"onset": ONSET, "optim": "sgd", "backward": True}),
    ("NaN in a model that returns its loss", "ddpm", styles.ddpm, {"onset": ONSET, "loss_fn": True}),
    ("NaN in a two-input model", "twotower", styles.twotower, {"onset": ONSET}),
    ("NaN in a per-example seq2seq, 2 optimizers", "seq2seq", styles.seq2seq, {"onset": ONSET, "loss_fn": True}),
]


def run(level: str, fn: Callable[..., Any], kw: dict[str, Any]) -> dict[str, Any]:
    made: list[Any] = []
    real = trackdiag.Diagnostics.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:
        real(self, *a, **k)
        made.append(self)

    trackdiag.Diagnostics.__init__ = init  # type: ignore[method-assign]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fn(level, Path(tmp), steps=60, every=10, **kw)
            except Exception:  # noqa: BLE001 - the crash cases
                pass
            order = {"info": 0, "warning": 1, "critical": 2}
            alerts = [a for a in made[0].alerts if order[a.severity] >= 1]
            first = min(alerts, key=lambda a: a.step) if alerts else None
            raised = next((r.step for r in read_records(tmp) if first is not None and
                           any((a.kind, a.step) == (first.kind, first.step) for a in r.alerts)), None)
    finally:
        trackdiag.Diagnostics.__init__ = real  # type: ignore[method-assign]
    if first is None:
        return {"cell": "no alert"}
    lead = next((a.message.split(":")[0][len("Before the crash, "):] for a in alerts
                 if a.kind == "crash" and a.message.startswith("Before the crash, ")), "–")
    return {"cell": f"`{first.kind}` +{first.step - ONSET} / +{(raised if raised is not None else first.step) - ONSET}",
            "where": first.where or "–", "plain": "could not be found" in first.message, "lead": lead}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--level", default="advanced")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    logging.getLogger("trackdiag").setLevel(logging.ERROR)
    print(f"| fault ({args.level}, every 10, onset {ONSET}) | script | first alert, +steps (named / raised) | where "
          "| crash finding leads with |")
    print("|---|---|---|---|---|")
    for label, script, fn, kw in CASES:
        got = run(args.level, fn, kw)
        where = got.get("where", "")
        if got.get("plain"):
            where += " (\"the culprit could not be found\")"
        print(f"| {label} | {script} | {got['cell']} | {where} | {got.get('lead', '–')} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``trackdiag summary RUN_DIR``: the alert table and health of a local run record.

Reads ``summary.json`` bounded and type-checked (:mod:`trackdiag.compare.safe_read`: at most
64 MB, 64 levels deep, regular files only); a malformed file gives one line naming the file, the
field and the reason, and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trackdiag.compare.safe_read import UnreadableFile, normalise_summary, read_json
from trackdiag.sinks.console import format_summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summary", help="print the alerts and health of a run directory")
    p.add_argument("run_dir", type=Path, help="a run's local record dir (holds summary.json)")
    p.add_argument("--json", action="store_true", help="print the raw summary.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the run's summary; 2 when there is none or it is malformed."""
    path = args.run_dir / "summary.json"
    try:
        raw = read_json(path)
        if raw is None:
            print(f"trackdiag: no summary.json in {args.run_dir} (run still going, or not a trackdiag run dir)")
            return 2
        summary = normalise_summary(raw)
    except UnreadableFile as e:
        print(f"trackdiag summary: cannot read {args.run_dir}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(raw, indent=2))
    else:
        print(format_summary({**summary, "health": summary["health"] or "?", "steps": summary["steps"] or 0,
                              "alerts": {k: {**a, "first_step": "" if a["first_step"] is None else a["first_step"]}
                                         for k, a in summary["alerts"].items()}}))
    return 0

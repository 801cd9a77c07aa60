"""``trackdiag summary RUN_DIR``: the alert table and health of a local run record."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from trackdiag.sinks.console import format_summary


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("summary", help="print the alerts and health of a run directory")
    p.add_argument("run_dir", type=Path, help="a run's local record dir (holds summary.json)")
    p.add_argument("--json", action="store_true", help="print the raw summary.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    path = args.run_dir / "summary.json"
    if not path.exists():
        print(f"trackdiag: no summary.json in {args.run_dir} (run still going, or not a trackdiag run dir)")
        return 2
    summary = json.loads(path.read_text())
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0

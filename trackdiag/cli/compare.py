"""``trackdiag compare SOURCE``: which runs of a sweep broke, how, when, and which settings did it.

SOURCE: a Hydra multirun dir (or any dir tree of trackdiag run dirs), ``mlflow:<experiment name or
id>`` (``mlflow:`` alone with ``--parent``) or ``wandb:<entity>/<project>[/<group>]``. A sweep that
lives only on a tracking server: ``mlflow: --parent <run id>`` or ``mlflow:<experiment> --sweep
<sweep id>``.
"""
from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``compare`` subcommand."""
    p = sub.add_parser("compare", help="compare the anomalies of the runs of a sweep",
                       description="Compare the health, alerts, first-anomaly step and losses of a sweep's runs.")
    p.add_argument("source", help="Hydra multirun dir / dir of runs, mlflow:<experiment>, wandb:<entity>/<project>[/<group>], "
                                  "or optuna:<storage-url>#<study> (the study's trials beside their runs' health)")
    p.add_argument("--format", choices=("table", "csv", "json"), default="table", help="stdout format (default: table)")
    p.add_argument("--out", type=Path, default=None,
                   help="also write comparison.{csv,json,html} and the plots (PNG) into this dir")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI)")
    p.add_argument("--parent", default=None, help="MLflow: only the child runs of this parent run id (a sweep); "
                   "the experiment may be left out (mlflow:)")
    p.add_argument("--sweep", default=None, help="MLflow: only the runs of the Hydra sweep whose dir ends with "
                   "this (e.g. 2026-06-01/12-00-00), found by its parent run")
    p.add_argument("--no-plots", action="store_true", help="with --out: skip the plots (faster)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, print in the chosen format, optionally write the outputs. Exit 2 if the source can't be
    read, 3 on any other failure: one line on stderr, never a traceback (malformed run dirs are
    skipped earlier, one warning line each)."""
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("trackdiag compare: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the last guard: one line instead of a traceback
        print(f"trackdiag compare: failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        return 3


def _run(args: argparse.Namespace) -> int:
    from trackdiag.compare import CompareError, compare, write_outputs

    err = sys.stderr
    try:
        with _progress() as progress:
            comparison = compare(args.source, tracking_uri=args.tracking_uri, parent=args.parent,
                                 sweep=args.sweep, progress=progress)
    except CompareError as e:
        print(f"trackdiag compare: {e}", file=err)
        return 2
    if args.format == "csv":
        from trackdiag.compare.table import to_csv

        sys.stdout.write(to_csv(comparison))
    elif args.format == "json":
        from trackdiag.compare.table import to_json

        print(to_json(comparison))
    else:
        _print_table(comparison)
    if args.out is not None:
        written = write_outputs(comparison, args.out, plots=not args.no_plots)
        print(f"trackdiag compare: wrote {', '.join(p.name for p in written.values())} to {args.out}",
              file=err if args.format != "table" else sys.stdout)
    return 0


def _print_table(comparison: Any) -> None:
    """The rich table and risk summary, or plain text without rich."""
    from trackdiag.compare.table import render_text, rich_renderables

    try:
        from rich.console import Console
    except ImportError:
        print(render_text(comparison))
        return
    console = Console()
    if not console.is_terminal:  # piped: don't squeeze the table into 80 columns
        console = Console(width=240)
    for item in rich_renderables(comparison):
        console.print(item)


def _progress() -> ContextManager[Callable[[int, int], None] | None]:
    """A rich progress bar on stderr fed by ``progress(done, total)``; nothing without rich or a terminal."""
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return nullcontext(None)
    console = Console(stderr=True)
    if not console.is_terminal:
        return nullcontext(None)
    return _RichProgress(Progress(TextColumn("reading runs"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console, transient=True))


class _RichProgress:
    """Context manager yielding a ``progress(done, total)`` callback that drives a rich bar."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar
        self.task: Any = None

    def __enter__(self) -> Callable[[int, int], None]:
        self.bar.__enter__()
        self.task = self.bar.add_task("runs", total=None)
        return self.update

    def update(self, done: int, total: int) -> None:
        """Move the bar to ``done`` of ``total``."""
        self.bar.update(self.task, completed=done, total=total)

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

"""``trackdiag`` command line. Each module in this package adds one subcommand through
``register(subparsers)``; adding a command is adding a file."""
from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trackdiag", description="Training diagnostics for PyTorch loops.")
    sub = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""The ``safeckpt`` command (``ls``/``show``/``verify`` and more come with the CLI issue)."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .checkpoint import verify
from .errors import CheckpointError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safeckpt", description="Crash-safe checkpoints for PyTorch: inspect and check them.")
    parser.add_argument("--version", action="version", version=f"safeckpt {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("verify", help="read every byte of a checkpoint and check its checksums")
    p.add_argument("paths", nargs="+", help="checkpoint folders or URLs")
    return parser


def _verify(paths: list[str]) -> int:
    status = 0
    for path in paths:
        report = verify(path)
        if report.ok:
            print(f"ok       {path} ({report.bytes_checked} bytes checked)")
        else:
            status = 1
            print(f"CORRUPT  {path}")
            for problem in report.problems:
                print(f"  - {problem}")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return _verify(args.paths)
    except (CheckpointError, OSError) as exc:
        if args.debug:
            raise
        print(f"safeckpt: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

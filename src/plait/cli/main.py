"""``plait``: the command line. Thin: it parses flags into config dataclasses and calls the library."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from . import bench, cluster, demo, simulate, train

    parser = argparse.ArgumentParser(
        prog="plait", description="Fused compute–collective operators and heterogeneity-aware "
                                  "tensor parallelism for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, bench, cluster, simulate, train):
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # a user mistake: one clear line, no traceback
        print(f"plait: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("plait: interrupted; everything it started has been stopped", file=sys.stderr)
        return 130

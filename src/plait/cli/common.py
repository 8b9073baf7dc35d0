"""Flags every distributed command shares: where to run and what to write."""

from __future__ import annotations

import argparse

from ..runtime import parse_rate, parse_slow, validate_slow

__all__ = ["add_launch_args", "add_output_args", "resolve_placement"]


def add_launch_args(parser: argparse.ArgumentParser, ranks: int = 2) -> None:
    group = parser.add_argument_group("where it runs")
    group.add_argument("--ranks", type=int, default=None,
                       help=f"number of ranks (default: --hosts, else {ranks})")
    group.add_argument("--hosts", type=int, default=0,
                       help="emulated hosts, each a network namespace (default 0: loopback)")
    group.add_argument("--link", default=None,
                       help="each host's link rate, shaped with tc tbf, e.g. 100mbit, 1gbit "
                            "(default 1gbit when --hosts is given)")
    group.add_argument("--timeout", type=float, default=None,
                       help="seconds before any collective gives up (default 60)")
    parser.set_defaults(default_ranks=ranks)


def add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--quick", action="store_true", help="a small sweep that finishes fast")
    group.add_argument("--json", metavar="PATH", default=None, help="write the records as JSON")
    group.add_argument("--plot", metavar="PATH", default=None, help="write a PNG plot")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_placement(args: argparse.Namespace) -> tuple[int, int, str | None]:
    """(ranks, hosts, link) from the flags, refused with a clear error before anything starts."""
    hosts = args.hosts
    if hosts < 0:
        raise ValueError(f"--hosts must be 0 (loopback) or more, got {hosts}")
    if args.link is not None and hosts == 0:
        hosts = args.ranks or args.default_ranks  # a link rate asks for an emulated cluster
    ranks = args.ranks if args.ranks is not None else (hosts or args.default_ranks)
    if ranks < 1:
        raise ValueError(f"world size (--ranks) must be at least 1, got {ranks}")
    link = args.link or ("1gbit" if hosts else None)
    parse_rate(link)
    if hosts and ranks % hosts:
        raise ValueError(f"--ranks {ranks} does not divide over --hosts {hosts}")
    if getattr(args, "slow", None):
        args.slow_specs = [parse_slow(s) for s in args.slow]
        validate_slow(args.slow_specs, ranks)
    return ranks, hosts, link

"""``plait bench …``: every benchmark prints a table, and writes --json / --plot on request.

Each benchmark's flags and run live in its own ``cli/bench_NAME.py``, imported only when it
is the one named (``commands.BENCHMARKS``)."""

from __future__ import annotations

from .commands import BENCHMARKS, add_commands

__all__ = ["register"]


def register(parser, rest: list[str] | None) -> None:
    """``plait bench BENCHMARK …``: the benchmarks of ``commands.BENCHMARKS``."""
    which = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    add_commands(which, BENCHMARKS, rest)

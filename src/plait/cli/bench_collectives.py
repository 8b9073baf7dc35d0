"""``plait bench collectives``: nccl-tests' figures (latency, algbw, busbw, link share) for
torch.distributed's collectives and plait's shared-memory transport, per message size."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..bench.config.collectives import CollectiveBenchConfig
from ..bench.report import console, counted, human_bytes, print_table, progress_bar, write_json
from ..runtime import parse_rate
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     placement_of_many, resolve_placement, transports)

__all__ = ["register", "run_collectives"]

DESCRIPTION = ("Latency, algbw and busbw (nccl-tests' definitions) and the share of the link per "
               "collective and message size, median over timed iterations; the largest message "
               "also as --pieces calls in flight, and why a collective falls short of the link "
               "in one call.")


def register(parser, _rest=None) -> None:
    """Its flags: where it runs, what it writes, and CollectiveBenchConfig's fields."""
    parser.description = DESCRIPTION
    add_launch_args(parser, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, CollectiveBenchConfig)
    parser.set_defaults(func=run_collectives)


QUICK_COLLECTIVES = dict(min_bytes=4 * 1024, max_bytes=16 * 1024 * 1024, step_factor=4,
                         max_iters=10, budget_s=0.25)
FULL_COLLECTIVES = dict(min_bytes=1024, max_bytes=64 * 1024 * 1024, step_factor=2,
                        max_iters=20, budget_s=0.5)


def run_collectives(args: argparse.Namespace) -> int:
    many = transports(args, many=True)
    ranks, hosts, link = resolve_placement(args) if len(many) == 1 else \
        placement_of_many(args)
    cfg = dataclass_from_args(CollectiveBenchConfig, args,
                              defaults=QUICK_COLLECTIVES if args.quick else FULL_COLLECTIVES)
    cfg = replace(cfg, transports=many)
    _check_memory(cfg.max_bytes, ranks)
    check_outputs(args, "json", "plot")
    # torch loads here, once the flags have passed
    from ..bench.collectives import (LINK_SHARE_OK, bench_collectives, plot_bandwidth,
                                     shortfalls, sweep_sizes)

    total = len(cfg.collectives) * len(sweep_sizes(cfg)) * len(many)  # a point a transport
    with progress_bar("bench collectives", total, enabled=not args.no_progress) as advance:
        records, where = bench_collectives(
            cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
            on_progress=lambda rank, p: rank == 0 and advance(
                note=f"{p['collective']} {human_bytes(p['bytes'])}"))
    if not where.startswith("loopback (no emulated cluster:"):  # the fallback already said why
        console.print(f"[dim]{where}[/dim]")
    for name, reason in dict.fromkeys((r["transport"], r["transport_reason"]) for r in records):
        console.print(f"[dim]transport: {name} ({reason})[/dim]")
    link_GBps = (parse_rate(records[0]["link"]) or 0) / 8e9 if records else 0
    pieces = max((r["pieces"] for r in records), default=0)
    columns = ["collective", "size", "transport", "time (µs)", "algbw (GB/s)", "busbw (GB/s)",
               "copy (GB/s)", "busbw / copy", "link share",
               f"{pieces} in flight" + (": link share" if link_GBps else " (µs)"),
               "#wrong", "iters × reps"]
    rows = [[r["collective"], human_bytes(r["bytes"]), r["transport"],
             f"{r['time_s'] * 1e6:,.1f}", f"{r['algbw_GBps']:.4f}", f"{r['busbw_GBps']:.4f}",
             f"{r['copy_GBps']:.2f}", f"{r['busbw_over_copy']:.0%}", _share(r["link_share"]),
             _pieces_cell(r), r["wrong"], f"{r['iters']} × {r['reps']}"] for r in records]
    if not pieces:  # --pieces 0: no column for them
        columns.pop(9)
        rows = [row[:9] + row[10:] for row in rows]
    print_table(f"collectives on {counted(ranks, 'rank')} ({records[0]['link'] if records else ''})",
                columns, rows,
                caption="median over timed iterations, each reps calls back to back, per call; "
                        "each iteration's time is the slowest rank's; copy = one core's "
                        "memcpy of the message in the same run (the one-host limit); link "
                        "share = busbw / link rate (over 100 % at small sizes: "
                        "the token bucket's burst, max(1 ms of line rate, 64 KiB), passes at "
                        "once); in flight: the largest message as that many calls at once, each "
                        "a piece of it")
    notes = shortfalls(records)
    for name, note in notes.items():
        console.print(f"[yellow]{name}[/yellow] under {LINK_SHARE_OK:.0%} of the link: {note}")
    if args.json:
        write_json(args.json, records, {"command": "bench collectives", "where": where,
                                        "shortfalls": notes})
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_bandwidth(records, args.plot, link_GBps or None)
        console.print(f"wrote {args.plot}")
    wrong = sum(r["wrong"] for r in records)
    if wrong:
        console.print(f"[red]{wrong} wrong elements: the collectives returned wrong results[/red]")
    return 1 if wrong else 0


def _share(share: float | None) -> str:
    return "–" if share is None else f"{share:.0%}"


def _pieces_cell(record: dict) -> str:
    if not record["pieces"]:
        return ""
    if record["pieces_link_share"] is not None:
        return _share(record["pieces_link_share"])
    return f"{record['pieces_time_s'] * 1e6:,.0f}"


def _check_memory(max_bytes: int, ranks: int) -> None:
    """Each rank holds at least a send and a receive buffer of the largest message: refuse a
    sweep this machine's memory cannot hold before starting its ranks."""
    import os

    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return
    need = 2 * max_bytes * ranks
    if need > total:
        raise ValueError(f"--max-bytes {max_bytes} needs at least {human_bytes(need)} on {ranks} "
                         f"ranks (a send and a receive buffer each); this machine has "
                         f"{human_bytes(total)}")

"""``plait bench …``: every benchmark prints a table, and writes --json / --plot on request."""

from __future__ import annotations

import argparse

from ..bench.collectives import CollectiveBenchConfig, bench_collectives, plot_bandwidth
from ..bench.report import console, human_bytes, print_table, progress_bar, write_json
from ..runtime import parse_rate
from .args import add_dataclass_args, dataclass_from_args
from .common import add_launch_args, add_output_args, resolve_placement

__all__ = ["register"]

QUICK_COLLECTIVES = dict(min_bytes=4 * 1024, max_bytes=16 * 1024 * 1024, step_factor=4,
                         max_iters=10, budget_s=0.25)
FULL_COLLECTIVES = dict(min_bytes=1024, max_bytes=64 * 1024 * 1024, step_factor=2,
                        max_iters=20, budget_s=0.5)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: collectives, fused operators, …")
    which = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    coll = which.add_parser("collectives", help="nccl-tests-style sweep of torch.distributed collectives",
                            description="Latency, algbw and busbw (nccl-tests' definitions) per "
                                        "collective and message size; median over timed iterations.")
    add_launch_args(coll)
    add_output_args(coll)
    add_dataclass_args(coll, CollectiveBenchConfig)
    coll.set_defaults(func=run_collectives)


def run_collectives(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(CollectiveBenchConfig, args,
                              defaults=QUICK_COLLECTIVES if args.quick else FULL_COLLECTIVES)
    from ..bench.collectives import sweep_sizes

    total = len(cfg.collectives) * len(sweep_sizes(cfg))
    with progress_bar("bench collectives", total, enabled=not args.no_progress) as advance:
        records, where = bench_collectives(
            cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
            on_progress=lambda rank, p: rank == 0 and advance(
                note=f"{p['collective']} {human_bytes(p['bytes'])}"))
    if not where.startswith("loopback (no emulated cluster:"):  # the fallback already said why
        console.print(f"[dim]{where}[/dim]")
    link_GBps = (parse_rate(records[0]["link"]) or 0) / 8e9 if records else 0
    rows = [[r["collective"], human_bytes(r["bytes"]), f"{r['time_s'] * 1e6:,.0f}",
             f"{r['algbw_GBps']:.4f}", f"{r['busbw_GBps']:.4f}",
             f"{100 * r['busbw_GBps'] / link_GBps:.0f} %" if link_GBps else "–",
             r["wrong"], r["iters"]] for r in records]
    print_table(f"collectives on {ranks} ranks ({records[0]['link'] if records else ''})",
                ["collective", "size", "time (µs)", "algbw (GB/s)", "busbw (GB/s)", "busbw/link",
                 "#wrong", "iters"], rows,
                caption="median over timed iterations; each iteration's time is the slowest rank's")
    if args.json:
        write_json(args.json, records, {"command": "bench collectives", "where": where})
        console.print(f"wrote {args.json}")
    if args.plot:
        plot_bandwidth(records, args.plot, link_GBps or None)
        console.print(f"wrote {args.plot}")
    wrong = sum(r["wrong"] for r in records)
    if wrong:
        console.print(f"[red]{wrong} wrong elements: the collectives returned wrong results[/red]")
    return 1 if wrong else 0

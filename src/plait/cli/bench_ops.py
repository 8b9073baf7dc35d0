"""``plait bench ops``: each fused operator against compute-then-collective and the physical
limit."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..bench.config.ops import OpsBenchConfig
from ..bench.report import console, counted, print_summary, print_table, progress_bar, write_json
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     placement_of_many, resolve_placement, transports)

__all__ = ["register", "run_ops"]

DESCRIPTION = ("Compute alone, communication alone, unfused (one call; the same bytes in pieces), "
               "fused and the physical limit max(compute, bytes over the busiest link ÷ its "
               "rate) per operator and shape; a fused time under the limit is flagged.")


def register(parser, _rest=None) -> None:
    """Its flags: where it runs, what it writes, and OpsBenchConfig's fields."""
    parser.description = DESCRIPTION
    add_launch_args(parser, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, OpsBenchConfig)
    parser.add_argument("--wide", action="store_true",
                        help="every column in the table (17; the default shows 12)")
    parser.set_defaults(func=run_ops)


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


CAPTION = ("median over interleaved iterations, slowest rank; unfused: compute then one "
           "collective, or the same bytes as (n) collectives in flight, the faster; speedup = "
           "unfused/fused; limit: max(compute's fastest round, bytes over the busiest link ÷ "
           "its rate), on shared memory the sum compute + bus bytes ÷ one core's copy "
           "bandwidth (one core does both); effic. = limit/fused (! = beats the limit: a bug)")
WIDE_CAPTION = ("; beside = compute and transfer at once with no dependency; best fixed: the "
                "fastest fixed piece count and its time")


def _table(records: list[dict], wide: bool) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of the table: twelve, or with ``wide`` every figure (17); the
    transport's only where the records ran on more than one (the title names it)."""
    def row(r: dict) -> dict[str, str]:
        pieces = r["t_unfused_pieces_s"] < r["t_unfused_one_call_s"]
        return {
            "op": r["op"], "shape": "×".join(str(v) for v in r["shape"].values()),
            "transport": r["transport"], "compute": _ms(r["t_compute_s"]),
            "comm": _ms(r["t_comm_s"]),
            "unfused": (f"{_ms(r['t_unfused_pieces_s'])} ({r['unfused_pieces']})" if pieces
                        else _ms(r["t_unfused_one_call_s"])),
            "unfused 1 call": _ms(r["t_unfused_one_call_s"]),
            "unfused pieces": f"{_ms(r['t_unfused_pieces_s'])} ({r['unfused_pieces']})",
            "fused": _ms(r["t_fused_s"]), "limit": f"{_ms(r['t_limit_s'])} ({r['limit_kind']})",
            "copy GB/s": f"{r['copy_GBps']:.1f}", "beside": _ms(r["t_beside_s"]),
            "path/pieces": f"{r['path']}/{r['chunks']}", "speedup": f"{r['speedup']:.2f}",
            "vs 1 call": f"{r['speedup_one_call']:.2f}",
            "effic.": (f"[red]{r['efficiency']:.2f}![/red]" if r["beats_limit"]
                       else f"{r['efficiency']:.2f}"),
            "best fixed": (f"{r['best_fixed_chunks']}: {_ms(r['t_best_fixed_s'])}"
                           if r["best_fixed_chunks"] else "–"),
            "correct": "yes" if r["correct"] else "[red]NO[/red]"}

    columns = [c for c in (WIDE_COLUMNS if wide else COLUMNS)
               if c != "transport" or len({r["transport"] for r in records}) > 1]  # or titled
    return columns, [[row(r)[c] for c in columns] for r in records]


COLUMNS = ("op", "shape", "transport", "compute", "comm", "unfused", "fused", "limit",
           "path/pieces", "speedup", "effic.", "correct")
WIDE_COLUMNS = ("op", "shape", "transport", "compute", "comm", "unfused 1 call",
                "unfused pieces", "fused", "limit", "copy GB/s", "beside", "path/pieces",
                "speedup", "vs 1 call", "effic.", "best fixed", "correct")


def run_ops(args: argparse.Namespace) -> int:
    many = transports(args, many=True)
    ranks, hosts, link = resolve_placement(args) if len(many) == 1 else \
        placement_of_many(args)
    cfg = dataclass_from_args(OpsBenchConfig, args, defaults={"quick": args.quick})
    cfg = replace(cfg, transports=many)
    check_outputs(args, "json", "plot")
    from ..bench.ops import bench_ops, plot_ops, summarize_transports  # torch: flags passed

    shapes = cfg.shapes()
    with progress_bar("bench ops", len(shapes), enabled=not args.no_progress) as advance:
        records, where, calibration = bench_ops(
            cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
            on_progress=lambda rank, p: rank == 0 and advance(note=p["op"]))
    if not where.startswith("loopback (no emulated cluster:"):
        console.print(f"[dim]{where}[/dim]")
    on = ", ".join(dict.fromkeys(r["transport"] for r in records))
    columns, rows = _table(records, wide=args.wide)
    print_table(f"fused operators on {counted(ranks, 'rank')} "
                f"({records[0]['link'] if records else ''}; transport {on}), ms", columns, rows,
                caption=CAPTION + (WIDE_CAPTION if args.wide else
                                   "; --wide: every column, --json: every figure"))
    summary = summarize_transports(records)
    print_summary(summary, ".3f")
    for r in records:
        if r["beats_limit"]:
            console.print(f"[red]  {r['op']} {r['shape']}: fused {_ms(r['t_fused_s'])} ms beats "
                          f"the {r['limit_kind']} limit {_ms(r['t_limit_s'])} ms by more than "
                          f"{_ms(r['limit_tolerance_s'])} ms: the limit is not one[/red]")
        if r["path"] == "fallback":
            console.print(f"[dim]  {r['op']} {r['shape']}: fallback: {r['reason']}[/dim]")
    if args.json:
        write_json(args.json, records, {"command": "bench ops", "where": where, "summary": summary,
                                        "calibration": calibration})
        console.print(f"wrote {args.json}")
    if args.plot and records:
        plot_ops(records, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if summary["all_correct"] else 1

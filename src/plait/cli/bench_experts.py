"""``plait bench experts``: MoE experts placed by routed load and rank speed (with replicas of
hot experts) against even blocks, under skewed routing and a slow rank."""

from __future__ import annotations

import argparse

from ..bench.config.experts import QUICK_EXPERTS, ExpertsBenchConfig
from ..bench.report import console, counted, print_table, progress_bar, write_json
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     resolve_placement)

__all__ = ["register", "run_bench_experts"]

DESCRIPTION = ("Each step, every rank computes the expert work a placement gives it (its "
               "replicas' shares of the rows routed to each expert, gelu(x·W1)·W2) under "
               "routing skewed on purpose (uniform, zipf, a hot expert, a drifting skew) and "
               "--slow; per scenario and policy the median step (the slowest rank's), the "
               "ideal (all rows at the summed speeds), the imbalance and the moves. The "
               "all-to-alls are not timed: this is the expert work a placement sets.")


def register(parser, _rest=None) -> None:
    """Its flags: where it runs, what it writes, ExpertsBenchConfig's fields and --slow."""
    parser.description = DESCRIPTION
    add_launch_args(parser, ranks=2, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, ExpertsBenchConfig)
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR",
                        help="make a rank FACTOR × slower at its expert work (repeatable)")
    parser.set_defaults(func=run_bench_experts)


def run_bench_experts(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(ExpertsBenchConfig, args,
                              defaults=QUICK_EXPERTS if args.quick else None)
    if args.plot:
        raise ValueError(f"--plot {args.plot}: bench experts draws no plot (--json has every "
                         "step)")
    check_outputs(args, "json")
    from ..bench.experts import bench_experts, summarize_experts  # torch: flags passed

    slow = list(getattr(args, "slow_specs", ()))
    total = len(cfg.scenarios) * cfg.steps
    with progress_bar("bench experts", total, enabled=not args.no_progress) as advance:
        records, where = bench_experts(cfg, ranks=ranks, hosts=hosts, link=link,
                                       timeout_s=args.timeout, slow=slow,
                                       on_progress=lambda rank, p: rank == 0 and advance(
                                           note=f"{p['scenario']} step {p['step']}"))
    console.print(f"[dim]{where}[/dim]")
    rows = summarize_experts(records)
    slowed = ", ".join(f"rank {s.rank} {s.factor:g}×" for s in slow) or "no slow rank"
    print_table(f"{cfg.n_experts} experts, top-{cfg.top_k}, {cfg.tokens} tokens a step on "
                f"{counted(ranks, 'rank')} ({slowed})",
                ["scenario", "policy", "step (ms)", "ideal (ms)", "× ideal", "imbalance",
                 "moves", "replicas", "same losses"],
                [[r["scenario"], r["policy"], f"{1e3 * r['t_step_s']:.2f}",
                  f"{1e3 * r['t_ideal_s']:.2f}", f"{r['ratio_to_ideal']:.3f}",
                  f"{r['imbalance']:.3f}", str(r["moves"]), str(r["copies"]),
                  {True: "yes", False: "[red]NO[/red]", None: "–"}[r["same_losses"]]]
                 for r in rows],
                caption=f"medians over steps {cfg.warmup}–{cfg.steps - 1}, policies "
                        "interleaved step by step; a step is the slowest rank's expert work; "
                        "imbalance: slowest rank's time over the mean rank's; replicas: "
                        "copies beyond one per expert at the end; same losses: that placement "
                        "applied to a float64 MoE mid-training keeps the unmoved losses",
                labels=2)
    if args.json:
        write_json(args.json, records, {"command": "bench experts", "where": where,
                                        "summary": rows})
        console.print(f"wrote {args.json}")
    return 1 if any(r["same_losses"] is False for r in rows) else 0  # a move that changed them

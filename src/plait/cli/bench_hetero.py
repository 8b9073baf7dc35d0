"""``plait bench hetero``: a slow rank under each balancing policy, against the capacity-proportional
ideal."""

from __future__ import annotations

import argparse

from ..bench.config.hetero import QUICK_HETERO, HeteroBenchConfig
from ..bench.report import console, counted, print_summary, print_table, progress_bar, write_json
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     resolve_placement)

__all__ = ["register", "run_hetero"]

DESCRIPTION = ("Scenarios none, straggler-2x, graded and spike on 4 ranks (--ranks to change); per "
               "scenario and policy the median step time, the capacity-proportional ideal, the "
               "no-straggler time and the held-out loss and accuracy.")


def register(parser, _rest=None) -> None:
    """Its flags: where it runs, what it writes, and HeteroBenchConfig's fields."""
    parser.description = DESCRIPTION
    add_launch_args(parser, ranks=4, deadline_s=4 * DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, HeteroBenchConfig)
    parser.set_defaults(func=run_hetero)


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def run_hetero(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(HeteroBenchConfig, args, defaults=QUICK_HETERO if args.quick else None)
    cfg.check_world(ranks)
    cfg.check_placement(ranks, hosts)  # before the progress bar shows
    check_outputs(args, "json", "plot")
    from ..bench.hetero import bench_hetero  # torch: once the flags have passed
    from ..bench.hetero_summary import mean_over_seeds, plot_hetero, ratio_cell, summarize_hetero

    runs = len(cfg.runs())
    with progress_bar("bench hetero", runs, enabled=not args.no_progress) as advance:
        records, where = bench_hetero(cfg, ranks=ranks, hosts=hosts, link=link,
                                      timeout_s=args.timeout,
                                      on_progress=lambda rank, p: rank == 0 and advance(
                                          note=f"{p['scenario']}/{p['policy']} seed {p['seed']}"))
    console.print(f"[dim]{where}[/dim]")
    rows = mean_over_seeds(records)

    def ms(row, key):
        return _ms(row[key]) if key in row else "–"

    print_table(f"heterogeneity on {counted(ranks, 'rank')} ({records[0]['link'] if records else ''}), "
                f"GPT {cfg.n_layer}×{cfg.n_embd}, {cfg.steps} steps, {cfg.seeds} seed(s)",
                ["scenario", "policy", "step (ms)", "ideal", "no straggler",
                 "× ideal (per seed)",
                 "held-out loss", "held-out acc (spread)", "decisions"],
                [[r["scenario"], r["policy"], ms(r, "t_step_s"), ms(r, "t_ideal_s"),
                  ms(r, "t_no_straggler_s"),
                  ratio_cell(r),
                  f"{r['heldout_loss']:.3f}",
                  f"{100 * r['heldout_acc']:.1f} %" + (
                      f" (±{50 * r['heldout_acc_spread']:.1f})" if cfg.seeds > 1 else ""),
                  f"{r['decisions']:.0f}"] for r in rows],
                caption=f"median step time after {cfg.warmup} warm-up steps, slowest rank; a "
                        "seed's runs interleaved step by step; ideal: the capacity-proportional "
                        "step, or where longer the slow host's unmovable work at its budget "
                        "(--slow-by kernel); × ideal: median over seeds, then each seed's; "
                        "held-out figures the mean over seeds (spread: half the range)", labels=2)
    summary = summarize_hetero(records, cfg)
    print_summary(summary)
    if args.json:
        write_json(args.json, records, {"command": "bench hetero", "where": where,
                                        "summary": summary, "table": rows})
        console.print(f"wrote {args.json}")
    if args.plot and records:
        plot_hetero(records, args.plot)
        console.print(f"wrote {args.plot}")
    return 0

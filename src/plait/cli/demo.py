"""``plait demo``: the main job. A rank turns slow while training; the plain way against plait."""

from __future__ import annotations

import argparse
import time

from ..bench.report import console, print_table, progress_bar
from ..demo import DemoConfig, demo, summarize_demo, write_demo_report
from .args import add_dataclass_args, dataclass_from_args
from .common import add_launch_args, resolve_placement

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo", help="train a GPT while one rank turns slow: plain TP against plait",
        description="Trains the small GPT with tensor parallelism on an emulated cluster (loopback "
                    "where one cannot be made) while the last rank turns slow part-way, under the "
                    "plain baseline (unfused, even shards) and under plait (fused, semi "
                    "balancer); a table at the end and a report folder with plots and an HTML page.")
    add_launch_args(parser, ranks=2)
    parser.add_argument("--loopback", action="store_true",
                        help="no emulated cluster: every rank on loopback")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_dataclass_args(parser, DemoConfig)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    if not hosts and not args.loopback:
        hosts, link = ranks, link or "1gbit"
    cfg = dataclass_from_args(DemoConfig, args)
    start = time.perf_counter()
    with progress_bar("plait demo", 4 * cfg.steps, enabled=not args.no_progress) as advance:
        records, where = demo(cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
                              on_progress=lambda rank, p: rank == 0 and advance(
                                  note=f"step {p['step'] + 1}/{cfg.steps}, {p['system']}, "
                                       f"{'straggler' if p['scenario'] == 'slow' else 'no straggler'}"))
    wall = time.perf_counter() - start
    console.print(f"[dim]{where}[/dim]")
    rows = summarize_demo(records, cfg)
    print_table(f"GPT {cfg.n_layer}×{cfg.n_embd} on {ranks} ranks; rank {ranks - 1} "
                f"{cfg.factor:g}× slower from step {cfg.slow_from}",
                ["system", "path, policy", "step (ms)", "no straggler", "ideal", "× ideal",
                 "tokens/s", "held-out loss", "held-out acc"],
                [[r["system"], f"{'fused' if r['overlap'] else 'unfused'}, {r['policy']}",
                  f"{r['t_step_s'] * 1e3:.1f}", f"{r['t_step_no_straggler_s'] * 1e3:.1f}",
                  f"{r['t_ideal_s'] * 1e3:.1f}", f"{r['ratio_to_ideal']:.2f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['heldout_loss']:.3f}",
                  f"{100 * r['heldout_acc']:.1f} %"] for r in rows],
                caption=f"medians from step {cfg.slow_from + 3}, each step the slowest rank's; "
                        f"plait {rows[1]['speedup_vs_plain']:.2f}× the plain way")
    folder = write_demo_report(records, rows, cfg, where, wall)
    console.print(f"report: {folder}/index.html ({wall:.0f} s)")
    return 0

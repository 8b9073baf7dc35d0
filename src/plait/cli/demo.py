"""``plait demo``: the main job. A rank turns slow while training; the plain way against plait."""

from __future__ import annotations

import argparse
import os
import time

from ..bench.config.demo import QUICK_DEMO, WARMUP_STEPS, DemoConfig
from ..runtime.slow.straggler import parse_slow, validate_slow
from .args import add_dataclass_args, dataclass_from_args
from .common import add_launch_args, check_writable, resolve_placement

__all__ = ["register", "demo_config", "demo_placement"]


def register(parser, _rest=None) -> None:
    parser.description = ("Trains the small GPT with tensor parallelism on an emulated cluster "
                          "(loopback where one cannot be made) while the last rank turns slow "
                          "part-way, under the plain baseline (unfused, even shards) and under "
                          "plait (fused, semi balancer); a table at the end and a report folder"
                          " with plots and an HTML page. --quick: a smaller model and fewer "
                          "steps, about 20 s.")
    add_launch_args(parser, ranks=2)
    hosts = next(a for a in parser._actions if a.dest == "hosts")
    hosts.default = None  # the demo's default is a cluster; an explicit --hosts 0 is loopback
    hosts.help = ("emulated hosts, each a network namespace (default: one per rank; 0: loopback, "
                  "as --loopback)")
    parser.add_argument("--loopback", action="store_true",
                        help="no emulated cluster: every rank on this machine's loopback interface "
                             "(not with --hosts N or --link)")
    parser.add_argument("--quick", action="store_true",
                        help="a first look in about 20 s: "
                             + ", ".join(_flag(k, v) for k, v in QUICK_DEMO.items())
                             + " (flags given override these)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--slow", dest="demo_slow", metavar="RANK:FACTOR[@FROM]", default=None,
                        help="rank RANK turns FACTOR× slower from step FROM to the end (train's "
                             "and generate's --slow, without their -UNTIL: the demo's slowdown "
                             "lasts; default: the last rank, 2× from step 15; --quick: from "
                             f"step {QUICK_DEMO['slow_from']})")
    add_dataclass_args(parser, DemoConfig)
    parser.set_defaults(func=run)


def _fusion(rows: list[dict]) -> float:
    """plait's speed over the plain way's with no straggler: what fusion alone gives."""
    return rows[0]["t_step_no_straggler_s"] / rows[1]["t_step_no_straggler_s"]


def _flag(key: str, value) -> str:
    """A --quick preset entry as the flag that sets it (the slowdown's step is --slow's)."""
    return f"--slow …@{value}" if key == "slow_from" else f"--{key.replace('_', '-')} {value}"


def demo_placement(args: argparse.Namespace) -> tuple[int, int, str | None]:
    """(ranks, hosts, link): an emulated cluster of one host per rank unless --loopback or
    --hosts 0; flags that contradict each other are refused before anything starts."""
    loopback = args.loopback or args.hosts == 0
    asked = "--loopback" if args.loopback else "--hosts 0"
    if args.loopback and args.hosts:
        raise ValueError(f"--loopback runs every rank on loopback, --hosts {args.hosts} asks for "
                         "an emulated cluster: pass one of them")
    if loopback and args.link is not None:
        raise ValueError(f"{asked} runs every rank on loopback, --link {args.link} shapes an "
                         "emulated cluster's links: pass one of them")
    if loopback:
        args.hosts = 0
    elif args.hosts is None:  # the demo's default: one emulated host per rank
        args.hosts = args.ranks or args.default_ranks
    return resolve_placement(args)


def demo_config(args: argparse.Namespace, ranks: int | None = None) -> DemoConfig:
    """The flags given, then the --quick preset where asked, then the defaults. ``--slow``
    sets the slowed rank, its factor and its first step (one slowdown, to the end)."""
    text = getattr(args, "demo_slow", None)
    if text:
        spec = parse_slow(text)
        if spec.until_step is not None:
            raise ValueError(f"--slow {text}: the demo's rank stays slow to the end "
                             "(write RANK:FACTOR@FROM, no -UNTIL)")
        validate_slow([spec], ranks or args.ranks or args.default_ranks)
        args.slow_rank, args.factor = spec.rank, spec.factor
        if "@" in text:
            args.slow_from = spec.from_step
    return dataclass_from_args(DemoConfig, args, defaults=QUICK_DEMO if args.quick else None)


def run(args: argparse.Namespace) -> int:
    ranks, hosts, link = demo_placement(args)
    cfg = demo_config(args, ranks)
    check_writable(cfg.out, "--out", directory=True)  # before the runs, not after them
    from ..bench.demo import demo, summarize_demo  # torch: once the flags have passed
    from ..bench.demo_report import busy_note, cores_busy, write_demo_report
    from ..bench.report import console, counted, print_table, progress_bar

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    busy = cores_busy()
    start = time.perf_counter()
    with progress_bar("plait demo", 4 * cfg.steps, enabled=not args.no_progress) as advance:
        records, where = demo(cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
                              on_progress=lambda rank, p: rank == 0 and advance(
                                  note=f"step {p['step'] + 1}/{cfg.steps}, {p['system']}, "
                                       f"{'straggler' if p['scenario'] == 'slow' else 'no straggler'}"))
    wall = time.perf_counter() - start
    console.print(f"[dim]{where}[/dim]")
    rows = summarize_demo(records, cfg)
    print_table(f"GPT {cfg.n_layer}×{cfg.n_embd} on {counted(ranks, 'rank')}; rank {cfg.slowed(ranks)} "
                f"{cfg.factor:g}× slower from step {cfg.slow_from}",
                ["system", "path, policy", "step (ms)", "no straggler", "ideal", "× ideal",
                 "tokens/s", "held-out loss", "held-out acc"],
                [[r["system"], f"{'fused' if r['overlap'] else 'unfused'}, {r['policy']}",
                  f"{r['t_step_s'] * 1e3:.1f}", f"{r['t_step_no_straggler_s'] * 1e3:.1f}",
                  f"{r['t_ideal_s'] * 1e3:.1f}", f"{r['ratio_to_ideal']:.2f}",
                  f"{r['tokens_per_s']:,.0f}", f"{r['heldout_loss']:.3f}",
                  f"{100 * r['heldout_acc']:.1f} %"] for r in rows],
                caption=f"medians from step {cfg.slow_from + WARMUP_STEPS}, each step the slowest "
                        f"rank's; plait {rows[1]['speedup_vs_plain']:.2f}× the plain way: "
                        f"{_fusion(rows):.2f}× without the straggler (fusion), and × ideal "
                        f"{rows[0]['ratio_to_ideal']:.2f} → {rows[1]['ratio_to_ideal']:.2f} with it "
                        "(balancing)" + (
                            "; under 1: the ideal is built from the speeds this run measured, "
                            "its noise with them" if min(r["ratio_to_ideal"] for r in rows) < 1
                            else ""))
    note = busy_note(busy, os.cpu_count() or 1)
    if note:
        console.print(f"[yellow]{note}[/yellow]")
    folder = write_demo_report(records, rows, cfg, where, wall, load=load, busy=busy)
    console.print(f"report: {folder}/index.html ({wall:.0f} s)")
    return 0

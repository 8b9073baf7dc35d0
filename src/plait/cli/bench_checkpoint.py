"""``plait bench checkpoint``: how long training waits for a blocking checkpoint and for an
asynchronous one (:mod:`plait.bench.checkpoint_stall`), every checkpoint's figure and the medians."""

from __future__ import annotations

import argparse

from ..bench.report import console, counted, human_bytes, print_table, progress_bar, write_json
from ..bench.checkpoint_stall import QUICK_CHECKPOINT, CheckpointBenchConfig, bench_checkpoint
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     check_writable, remove_empty_folders, resolve_placement)

__all__ = ["register", "run_checkpoint"]

DESCRIPTION = (
    "A GPT made tensor-parallel over the ranks (by default bench tp's) trains and checkpoints "
    "with plait.checkpoint.Checkpointer, blocking and asynchronous saves taking turns, "
    "--every steps after each. Per checkpoint, the slowest rank's stall (the save call, during "
    "which training waits), the asynchronous save's write still running when the next "
    "checkpoint comes, and the interval extra (stall plus the steps after, minus as many "
    "plain steps); their medians and the plain step. The checkpoints go to a new temporary "
    "folder, removed at the end.")


def register(parser, _rest=None) -> None:
    """Add ``checkpoint`` to ``plait bench``'s subcommands."""
    parser.description = DESCRIPTION
    add_launch_args(parser, ranks=2, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, CheckpointBenchConfig)
    parser.set_defaults(func=run_checkpoint)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}"


def _print(records: list[dict], summary: dict, cfg: CheckpointBenchConfig, ranks: int) -> None:
    by = {(r["kind"], r["checkpoint"]): r for r in records}
    rows = [[str(n), _ms(by["blocking", n]["stall_s"]), _ms(by["async", n]["stall_s"]),
             _ms(by["async", n]["async_wait_s"]), _ms(by["blocking", n]["interval_extra_s"]),
             _ms(by["async", n]["interval_extra_s"])] for n in range(1, cfg.checkpoints + 1)]
    rows.append(["median", *(f"[bold]{_ms(summary[key])}[/bold]" for key in (
        "blocking_stall_s", "async_stall_s", "async_wait_s", "blocking_interval_extra_s",
        "async_interval_extra_s"))])
    link = records[0]["link"] if records else ""
    steps = f"{cfg.every} step{'s' if cfg.every != 1 else ''}"
    print_table(f"checkpoint stall on {counted(ranks, 'rank')} ({link}): GPT {cfg.n_layer}×{cfg.n_embd} "
                f"({cfg.n_head} heads), batch {cfg.batch_size}×{cfg.seq_len}, AdamW; "
                f"{human_bytes(summary['checkpoint_bytes'])} a checkpoint",
                ["checkpoint", "blocking stall (ms)", "async stall (ms)",
                 f"async write left after {steps} (ms)",
                 "blocking interval extra (ms)", "async interval extra (ms)"], rows,
                caption=f"blocking and asynchronous checkpoints take turns, {steps} after "
                        "each; each figure the slowest rank's; plain step (median of "
                        f"{cfg.plain_steps}): {_ms(summary['plain_step_s'])} ms; interval extra "
                        f"= stall + the {steps} after − as many plain steps")
    console.print(f"  the asynchronous save stalls training {summary['blocking_over_async']:.1f} "
                  "× less than the blocking one (medians)")


def run_checkpoint(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(CheckpointBenchConfig, args,
                              defaults=QUICK_CHECKPOINT if args.quick else None)
    cfg.check_world(ranks)
    if args.plot:
        raise ValueError(f"--plot {args.plot}: bench checkpoint draws no plot (its --json has "
                         "every checkpoint)")
    made = check_writable(cfg.checkpoint_dir, "--checkpoint-dir", directory=True)
    try:
        check_outputs(args, "json")
        with progress_bar("bench checkpoint", cfg.progress_total,
                          enabled=not args.no_progress) as advance:
            records, summary, where = bench_checkpoint(
                cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
                on_progress=lambda rank, p: rank == 0 and advance(
                    note=p.get("phase") or f"{p['kind']} {p['n'] + 1}/{p['of']}"))
    finally:
        remove_empty_folders(made)
    if not where.startswith("loopback (no emulated cluster:"):
        console.print(f"[dim]{where}[/dim]")
    _print(records, summary, cfg, ranks)
    if args.json:
        write_json(args.json, records, {"command": "bench checkpoint", "where": where,
                                        "summary": summary, "config": _config(cfg)})
        console.print(f"wrote {args.json}")
    return 0


def _config(cfg: CheckpointBenchConfig) -> dict:
    from dataclasses import asdict

    return {k: v for k, v in asdict(cfg).items() if k not in ("extra", "checkpoint_dir")}

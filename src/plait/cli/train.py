"""``plait train``: train a small model on N ranks, with a progress bar, a loss curve and a log."""

from __future__ import annotations

import argparse
import os
import time

from ..runtime.slow.scenario_file import load_scenario
from ..training.config import TrainConfig
from .args import add_dataclass_args, dataclass_from_args
from .common import add_launch_args, check_writable, remove_empty_folders, resolve_placement

__all__ = ["register", "run_train"]


def register(parser, _rest=None) -> None:
    parser.description = ("Trains on data that needs no download (stdlib source text for the "
                          "GPTs and the transformers models, a synthetic Zipf click log for "
                          "DLRM) and writes DIR/loss.png and DIR/log.json (every step; held-out"
                          " loss and accuracy at the end). hf-llama and hf-mixtral are built "
                          "from a config (random weights, no download) and made parallel by "
                          "plait.parallelize(model, plan='auto').")
    add_launch_args(parser)
    add_dataclass_args(parser, TrainConfig)
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR[@FROM[-UNTIL]]",
                        help="make a rank FACTOR × slower at compute (repeatable)")
    parser.add_argument("--slow-file", default=None, metavar="PATH",
                        help="a scenario file: per-rank slowdowns by step, drift or jitter "
                             "(examples/scenarios/, format in docs/balancing.md)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where loss.png and log.json go (default reports/train/MODEL)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    for flag, value in (("--dp", args.dp), ("--tp", args.tp)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.ranks is None and args.tp is not None:  # --dp 2 --tp 2 --hosts 2: 4 ranks
        args.ranks = (args.dp or 1) * args.tp
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(TrainConfig, args)
    cfg = TrainConfig(**{**cfg.__dict__, "extra": {"ranks": ranks}})
    slow = list(getattr(args, "slow_specs", ()))
    if args.slow_file:  # read and checked before anything starts
        try:
            scenario = load_scenario(args.slow_file)
        except OSError as err:
            raise ValueError(f"--slow-file {args.slow_file}: {err.strerror or err}") from None
        slow += scenario.specs(ranks, cfg.steps)
    # torch loads here, once the flags and files have passed
    from ..bench.report import console, progress_bar
    from ..training.dp_tp import mesh_layout, placement_line
    from ..training.report import write_train_report
    from ..training.resume import checkpoint_note
    from ..training.run import train

    layout = mesh_layout(cfg, ranks)
    cfg.check_plans(layout.tp)  # a refused run prints nothing before its one line
    note = checkpoint_note(cfg)  # refuses a DIR with another run's checkpoints, before work
    out = args.out or f"reports/train/{cfg.model}"
    made = check_writable(out, "--out", directory=True)
    console.print(f"placement: {placement_line(layout, hosts)}")  # every refusal is behind
    if note:
        console.print(note, markup=False)
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    try:
        with progress_bar(f"train {cfg.model}", cfg.steps, enabled=not args.no_progress) as advance:
            def on_progress(rank, p):
                if "note" in p:  # resumed: what was restored and resharded, and from which step
                    console.print(p["note"], markup=False)
                    advance(p["step"])
                    return
                advance(note=f"loss {p['loss']:.3f}  {p['rate']:,.0f} {p['unit']}/s")
            result, where = train(cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
                                  on_progress=on_progress, slow=slow)
    except BaseException:
        remove_empty_folders(made)  # a refused or failed run leaves no empty report folder
        raise
    wall = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    summary = write_train_report(result, cfg, out, where, wall, load=load)
    console.print(f"[dim]{where}; {result['parallel']}[/dim]")
    console.print(f"loss {summary['first_tenth_mean_loss']:.3f} → {summary['last_tenth_mean_loss']:.3f}"
                  f" (mean of the first and last tenth of the steps); held-out loss "
                  f"{summary['heldout_loss']:.3f}, accuracy {summary['heldout_accuracy']:.3f}"
                  + (f"; the planted model's loss {summary['planted_model_loss']:.3f}"
                     if "planted_model_loss" in summary else ""))
    console.print(f"{cfg.steps} steps in {summary['train_s']:.1f} s ({wall:.1f} s in all); "
                  f"wrote {out}/loss.png and {out}/log.json")
    _print_ideal(summary, cfg, args)
    return 0


def _print_ideal(summary: dict, cfg, args: argparse.Namespace) -> None:
    """The median step against the capacity ideal (plait.training.report.capacity_ideal)."""
    from ..bench.report import console, print_table

    ideal = summary.get("ideal", {})
    if "t_ideal_s" not in ideal:
        console.print(f"capacity ideal: not computed ({ideal.get('omitted', 'no figures')})",
                      markup=False)
        return
    slowed = " ".join([f"--slow {s}" for s in args.slow]
                      + ([f"--slow-file {args.slow_file}"] if args.slow_file else [])) or "none"
    made = summary.get("balance", {}).get("decisions", ())
    for d in made:  # what the balancer did, a line each: its first clause (log.json: all)
        what = d["reason"].split(":")[0]
        console.print(f"[dim]step {d['step']:>4} {d['dim']}: {d['kind']} {what}[/dim]",
                      markup=True, overflow="ellipsis", no_wrap=True)
    decisions = len(made)
    load = summary.get("load_avg_1min", [])
    row = [cfg.balance, slowed, f"{1e3 * ideal['t_step_s']:.1f}",
           f"{1e3 * ideal['t_ideal_s']:.1f}", f"{ideal['ratio_to_ideal']:.2f}", str(decisions),
           " → ".join(f"{v:.1f}" for v in load)]
    print_table(f"step time, steps {ideal['warmup']}–{ideal['warmup'] + ideal['steps'] - 1} "
                "(median of the slowest rank's)",
                ["balance", "straggler", "step (ms)", "ideal (ms)", "× ideal", "decisions",
                 "load (1 min)"], [row], labels=2,
                caption="ideal: the step a perfect balancer would reach at these ranks' speeds "
                        "(the work over the summed speeds, plus what compute does not explain; "
                        "docs/training.md)")

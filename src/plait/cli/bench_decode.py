"""``plait bench decode``: per-token latency of tensor-parallel decoding (:mod:`plait.bench.decode`)
against one process and PyTorch's tensor parallelism, at several batch sizes."""

from __future__ import annotations

import argparse

from ..bench.config.decode import DecodeBenchConfig
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     resolve_placement)

__all__ = ["register", "run_decode"]

DESCRIPTION = (
    "A transformers Llama decodes --new-tokens tokens greedily with its KV cache after a "
    "--prompt-len prompt, at each of --batch-sizes, under plait (fused; and plain), PyTorch's "
    "tensor parallelism (DTensor) and one process, each in turn in balanced orders for "
    "--rounds rounds. Per system and batch: the median per-token latency, its 99th percentile, "
    "the time to first token, tokens/s, and whether the tokens equal one process's.")


def register(parser, _rest=None) -> None:
    parser.description = DESCRIPTION
    add_launch_args(parser, ranks=2, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, DecodeBenchConfig)
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR",
                        help="make a rank FACTOR × slower for the whole run (repeatable, a "
                             "rank once): with --slow-by sleep its compute in the split layers "
                             "of the plait systems (pytorch-tp and one-process run unslowed); "
                             "with --slow-by kernel its host's CPU budget, every system")
    parser.set_defaults(func=run_decode)


QUICK_DECODE = dict(batch_sizes=(1, 16), rounds=2, new_tokens=32)


def run_decode(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(DecodeBenchConfig, args, defaults=QUICK_DECODE if args.quick else None)
    check_outputs(args, "json", "plot")
    # torch loads here, once the flags have passed
    from ..bench.decode import bench_decode, check_slow, kernel_budgets, summarize
    from ..bench.report import (console, counted, print_summary, print_table, progress_bar,
                                write_json)

    slow = list(getattr(args, "slow_specs", ()))
    check_slow(slow)  # refused here, before any rank starts or a bar is drawn
    if cfg.slow_by == "kernel":
        kernel_budgets(ranks, hosts, slow)
    total = len(cfg.batch_sizes) * cfg.rounds
    with progress_bar("bench decode", total, enabled=not args.no_progress) as advance:
        records, where = bench_decode(cfg, ranks=ranks, hosts=hosts, link=link,
                                      timeout_s=args.timeout,
                                      slow=slow,
                                      on_progress=lambda rank, p: rank == 0 and advance(
                                          note=f"batch {p['batch']} round {p['round']}"))
    console.print(f"[dim]{where}[/dim]")
    timed = [r for r in records if "batch" in r]
    alone = {r["batch"]: r["ms_per_token"] for r in timed if r["system"] == "one-process"}
    rows = [[r["system"], str(r["batch"]), str(r["ranks_used"]), str(r["threads"]),
             r["transport"],
             f"{r['ms_per_token']:.2f}", f"{r['p99_ms']:.2f}", f"{r['ttft_ms']:.1f}",
             f"{r['tokens_per_s']:,.0f}",
             f"{r['ms_per_token'] / alone[r['batch']]:.2f}×" if r["batch"] in alone else "–",
             f"{r['ideal_ms']:.2f} ({r['ratio_to_ideal']:.2f}×)" if "ideal_ms" in r else "–",
             {True: "yes", False: "[red]NO[/red]", None: "–"}[r["same_tokens"]]] for r in timed]
    print_table(f"decoding a Llama {cfg.n_layer} × {cfg.n_embd} ({cfg.n_head} heads over "
                f"{cfg.n_kv_head} KV heads) on {counted(ranks, 'rank')}: {cfg.new_tokens} tokens after "
                f"{cfg.prompt_len}",
                ["system", "batch", "ranks", "threads", "transport", "ms / token", "p99 ms",
                 "TTFT ms",
                 "tokens/s", "× one process", "ideal ms (× ideal)", "same tokens"], rows,
                caption="median over every round's steps (a step: the slowest rank's); "
                        "threads: in all; one-process: the whole model on one rank, on as many "
                        "threads as the ranks use cores (× one process: ms / token over its, at "
                        "that batch); "
                        "-compiled: a static KV cache, the step compiled; TTFT: the prompt's forward "
                        "to the first token (median over rounds); ideal: the even split's step "
                        "less its slowest rank's compute in the split layers, plus all their "
                        "work at the ranks' summed speeds (plait.inference.split.decode_ideal)")
    for r in timed:
        if "split" in r:
            sizes = {d.rsplit(".", 1)[-1]: s for d, s in r["split"]["sizes"].items()}
            speeds = (f"speeds {[round(v, 2) for v in r['split']['speeds']]}, "
                      if "speeds" in r["split"] else "")
            console.print(f"[dim]  {r['system']} (batch {r['batch']}): {speeds}split "
                          f"{sizes}[/dim]")
    for r in records:
        if "skipped" in r:
            console.print(f"[dim]  {r['system']}: not run: {r['skipped']}[/dim]")
    summary = summarize(records)
    saving = any(key.endswith("_check_saving_ms") for key in summary)
    console.print("[dim]ratios of ms per token (below 1: faster): SYSTEM_bBATCH_vs_OTHER is "
                  "SYSTEM's over OTHER's at that batch; ratio_to_ideal: over the capacity "
                  "ideal" + ("; plait_bBATCH_check_saving_ms (not a ratio): the ms a token "
                             "plait-gather-checks takes over plait, what carrying the checks "
                             "in the data calls saves" if saving else "") + "[/dim]")
    print_summary({k: v for k, v in summary.items() if k != "slower_than_one_process"}, ".3f")
    for line in summary.get("slower_than_one_process", []):  # said in words, not buried
        console.print(f"[yellow]slower than one process: {line}[/yellow]")
    if cfg.rounds < 3:
        console.print(f"[dim]{cfg.rounds} round{'s' if cfg.rounds != 1 else ''}: ratios within "
                      "about 15 % of 1 swing either way between runs on a shared machine; "
                      "use --rounds 3 or more, and two runs[/dim]")
    if args.json:
        write_json(args.json, records, {"command": "bench decode", "where": where,
                                        "summary": summary})
        console.print(f"wrote {args.json}")
    if args.plot:
        _plot(timed, args.plot)
        console.print(f"wrote {args.plot}")
    return 0 if summary["all_same_tokens"] else 1


def _plot(records: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in dict.fromkeys(r["system"] for r in records):
        rows = [r for r in records if r["system"] == system]
        ax.plot([r["batch"] for r in rows], [r["ms_per_token"] for r in rows], marker="o",
                label=system)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (prompts decoded at once)")
    ax.set_ylabel("ms per token (median)")
    ax.set_title("plait bench decode")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

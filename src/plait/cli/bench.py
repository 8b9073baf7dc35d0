"""``plait bench …``: every benchmark prints a table, and writes --json / --plot on request."""

from __future__ import annotations

import argparse
import os
from dataclasses import replace

from ..bench.collectives import (LINK_SHARE_OK, CollectiveBenchConfig, bench_collectives,
                                 plot_bandwidth, shortfalls)
from ..bench.ops import OpsBenchConfig, bench_ops, plot_ops, summarize_transports
from ..bench.report import (console, human_bytes, print_summary, print_table, progress_bar,
                            write_json)
from ..bench.hetero import QUICK_HETERO, HeteroBenchConfig, bench_hetero
from ..bench.hetero_summary import mean_over_seeds, plot_hetero, ratio_cell, summarize_hetero
from ..bench.tp import QUICK_TP, TPBenchConfig, bench_tp, summarize_tp
from ..bench.tp_dp import print_placements
from ..runtime import parse_rate
from . import bench_checkpoint, bench_decode, bench_load
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     check_shm, resolve_placement, transports)

__all__ = ["register"]

QUICK_COLLECTIVES = dict(min_bytes=4 * 1024, max_bytes=16 * 1024 * 1024, step_factor=4,
                         max_iters=10, budget_s=0.25)
FULL_COLLECTIVES = dict(min_bytes=1024, max_bytes=64 * 1024 * 1024, step_factor=2,
                        max_iters=20, budget_s=0.5)


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks: collectives, fused operators, …")
    which = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    _add(which, "collectives", CollectiveBenchConfig, run_collectives,
         "nccl-tests-style sweep of torch.distributed collectives",
         "Latency, algbw and busbw (nccl-tests' definitions) and the share of the link per "
         "collective and message size, median over timed iterations; the largest message also "
         "as --pieces calls in flight, and why a collective falls short of the link in one call.")
    _add(which, "ops", OpsBenchConfig, run_ops, "fused operators against compute-then-collective",
         "Compute alone, communication alone, unfused (one call; the same bytes in pieces), "
         "fused and the physical limit max(compute, bytes over the busiest link ÷ its rate) "
         "per operator and shape; a fused time under the limit is flagged.")
    _add(which, "tp", TPBenchConfig, run_tp,
         "plait's tensor parallelism against PyTorch's (DTensor) on a GPT or a transformers Llama",
         "The same model (plait's GPT, or --model hf-llama: a transformers Llama from a config), "
         "weights, batches and optimizer under plait (fused and plain) and "
         "torch.distributed.tensor.parallel; median step time, tokens/s and the largest loss "
         "difference.")
    _add(which, "hetero", HeteroBenchConfig, run_hetero,
         "a slow rank under each balancing policy (even, static, resize, migrate, semi)",
         "Scenarios none, straggler-2x, graded and spike on 4 ranks (--ranks to change); per "
         "scenario and policy the median step time, the capacity-proportional ideal, the "
         "no-straggler time and the held-out loss and accuracy.",
         deadline_s=4 * DEFAULT_DEADLINE_S, ranks=4)  # every scenario × policy × seed, one launch
    bench_checkpoint.register(which)
    bench_load.register(which)
    bench_decode.register(which)


def _add(which, name: str, config: type, func, help_text: str, description: str,
         deadline_s: float = DEFAULT_DEADLINE_S, ranks: int = 2) -> None:
    """One benchmark: where it runs, what it writes, and its config's fields as flags."""
    parser = which.add_parser(name, help=help_text, description=description)
    add_launch_args(parser, ranks=ranks, deadline_s=deadline_s)
    add_output_args(parser)
    add_dataclass_args(parser, config)
    parser.set_defaults(func=func)


def run_collectives(args: argparse.Namespace) -> int:
    many = transports(args, many=True)
    ranks, hosts, link = resolve_placement(args) if len(many) == 1 else \
        _placement_of_many(args)
    cfg = dataclass_from_args(CollectiveBenchConfig, args,
                              defaults=QUICK_COLLECTIVES if args.quick else FULL_COLLECTIVES)
    cfg = replace(cfg, transports=many)
    _check_memory(cfg.max_bytes, ranks)
    check_outputs(args, "json", "plot")
    from ..bench.collectives import sweep_sizes

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
    print_table(f"collectives on {ranks} ranks ({records[0]['link'] if records else ''})",
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


def _placement_of_many(args: argparse.Namespace):
    """resolve_placement for a comma list of transports (none of them set for the ranks:
    the benchmark makes each itself)."""
    given, args.transport = args.transport, None
    try:
        ranks, hosts, link = resolve_placement(args)
    finally:
        args.transport = given
    check_shm(args, ranks, hosts)
    return ranks, hosts, link


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


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


def run_ops(args: argparse.Namespace) -> int:
    many = transports(args, many=True)
    ranks, hosts, link = resolve_placement(args) if len(many) == 1 else \
        _placement_of_many(args)
    cfg = dataclass_from_args(OpsBenchConfig, args, defaults={"quick": args.quick})
    cfg = replace(cfg, transports=many)
    check_outputs(args, "json", "plot")
    shapes = cfg.shapes()
    with progress_bar("bench ops", len(shapes), enabled=not args.no_progress) as advance:
        records, where, calibration = bench_ops(
            cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
            on_progress=lambda rank, p: rank == 0 and advance(note=p["op"]))
    if not where.startswith("loopback (no emulated cluster:"):
        console.print(f"[dim]{where}[/dim]")
    rows = [[r["op"], "×".join(str(v) for v in r["shape"].values()), r["transport"],
             _ms(r["t_compute_s"]),
             _ms(r["t_comm_s"]), _ms(r["t_unfused_one_call_s"]),
             f"{_ms(r['t_unfused_pieces_s'])} ({r['unfused_pieces']})", _ms(r["t_fused_s"]),
             f"{_ms(r['t_limit_s'])} ({r['limit_kind']})", f"{r['copy_GBps']:.1f}",
             _ms(r["t_beside_s"]), f"{r['path']}/{r['chunks']}",
             f"{r['speedup']:.2f}", f"{r['speedup_one_call']:.2f}",
             f"[red]{r['efficiency']:.2f}![/red]" if r["beats_limit"] else f"{r['efficiency']:.2f}",
             f"{r['best_fixed_chunks']}: {_ms(r['t_best_fixed_s'])}" if r["best_fixed_chunks"] else "–",
             "yes" if r["correct"] else "[red]NO[/red]"] for r in records]
    # a lower bound: its measured terms are their fastest round (the columns are medians)
    limit_text = ("limit = max(compute's fastest round, link: bytes over the busiest link ÷ "
                  "link rate; measured: the collective alone); on shared memory (copy) the sum "
                  "compute + the bus bytes ÷ one core's copy bandwidth: one core does both")
    on = ", ".join(dict.fromkeys(r["transport"] for r in records))
    print_table(f"fused operators on {ranks} ranks ({records[0]['link'] if records else ''}; "
                f"transport {on}), ms",
                ["op", "shape", "transport", "compute", "comm", "unfused 1 call", "unfused pieces",
                 "fused", "limit", "copy GB/s", "beside", "path/pieces", "speedup", "vs 1 call", "effic.",
                 "best fixed", "correct"], rows,
                caption="median over interleaved iterations, slowest rank; unfused pieces = "
                        "compute, then the same bytes as (n) collectives in flight; speedup = "
                        "min(unfused 1 call, pieces)/fused, vs 1 call = unfused 1 call/fused; "
                        f"{limit_text}, efficiency = limit/fused (! = beats the limit: a bug); "
                        "beside = compute and transfer at once with no dependency")
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


def _tp_rows(records: list[dict], key: str) -> list[list]:
    return [[r["system"], _ms(r["t_step_s"]), f"{r['tokens_per_s']:,.0f}",
             f"{r[key]:.2f}" if r.get(key) else "–",
             "–" if r["max_loss_diff"] is None
             else f"{r['max_loss_diff']:.2e} (vs {r['loss_diff_vs']})",
             f"{r['losses'][0]:.4f} → {r['losses'][-1]:.4f}"] for r in records]


def _dense_title(r: dict) -> str:
    m = r["model"]
    if m.get("name") == "hf-llama":
        return (f"transformers Llama {m['n_layer']}×{m['n_embd']} ({m['n_head']} heads, "
                f"{m['n_kv_head']} KV heads, MLP {m['ffn']}, vocab {m['vocab']}, plan "
                f"{m['plan']})")
    return f"GPT {m['n_layer']}×{m['n_embd']} ({m['n_head']} heads)"


def _distinct_wires(records: list[dict]) -> list[dict]:
    """One record per distinct all-reduce count (plait sums siblings' input grads)."""
    seen: dict[int, dict] = {}
    for r in records:
        seen.setdefault(r["allreduce_per_step"], r)
    return list(seen.values())


def _print_tp(records: list[dict], ranks: int, cfg) -> None:
    gpt = [r for r in records if r["part"] in ("gpt", "hf-llama")]
    emb = [r for r in records if r["part"] == "dlrm" and not r.get("skipped")]
    link = records[0]["link"] if records else ""
    caption = (f"median over {cfg.steps} timed steps after {cfg.warmup} warm-up, each step's time "
               "the slowest rank's; steps interleaved")
    if gpt:
        m, wire = gpt[0]["model"], gpt[0]["t_comm_link_s"]
        gathers = (f" and an all-gather of {human_bytes(gpt[0]['allgather_bytes'])}"
                   if gpt[0].get("allgather_bytes") else "")
        wires = _distinct_wires(gpt)
        wire_note = "".join(
            f"; {'its' if len(wires) == 1 else r['system'] + chr(39) + 's'} "
            f"{r['allreduce_per_step']} all-reduces of "
            f"{human_bytes(r['allreduce_bytes'])}{gathers} take ≥ {_ms(r['t_comm_link_s'])} ms a "
            "step at the link rate" for r in wires) if wire else ""
        print_table(f"tensor parallelism on {ranks} ranks ({link}): {_dense_title(gpt[0])}, "
                    f"batch {m['batch_size']}×{m['seq_len']}, {gpt[0]['optimizer']}",
                    ["system", "step (ms)", "tokens/s", "× pytorch-tp",
                     f"max |Δloss|, first {cfg.compare_steps} steps", "loss first → last"],
                    _tp_rows(gpt, "speedup_vs_pytorch_tp"), caption=caption + wire_note)
    if emb:
        m = emb[0]["model"]
        print_table(f"DLRM embeddings on {ranks} ranks ({link}): {m['tables']} tables × "
                    f"{m['rows']:,} × {m['dim']}, batch {m['batch']}, pool {m['pool']}",
                    ["system", "step (ms)", "samples/s", "× torchrec",
                     f"max |Δloss|, first {cfg.compare_steps} steps", "loss first → last"],
                    _tp_rows(emb, "speedup_vs_torchrec"), caption=caption)
    for r in records:
        if r.get("skipped"):
            console.print(f"[yellow]DLRM embeddings against TorchRec skipped: {r['skipped']}[/yellow]")


def run_tp(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(TPBenchConfig, args, defaults=QUICK_TP if args.quick else None)
    if args.ranks is None and cfg.mesh_ranks is not None:  # --dp N --tp M: N × M ranks
        ranks = cfg.mesh_ranks
        if hosts and ranks % hosts:
            raise ValueError(f"--dp {cfg.dp} × --tp {cfg.tp} = {ranks} ranks do not divide "
                             f"over --hosts {hosts}")
    cfg.check_world(ranks)
    if args.plot:
        raise ValueError(f"--plot {args.plot}: bench tp draws no plot (its --json has every step)")
    check_outputs(args, "json")
    total = cfg.total_steps * (2 if cfg.runs_dlrm else 1)
    with progress_bar("bench tp", total, enabled=not args.no_progress) as advance:
        records, where = bench_tp(cfg, ranks=ranks, hosts=hosts, link=link, timeout_s=args.timeout,
                                  on_progress=lambda rank, p: rank == 0 and advance(
                                      note=f"{p.get('part', 'gpt')} step {p['step'] + 1}/{p['of']}"))
    if not where.startswith("loopback (no emulated cluster:"):
        console.print(f"[dim]{where}[/dim]")
    if cfg.dp > 1:  # the two placements of one dp × tp mesh, measured and predicted
        print_placements(records)
    else:
        _print_tp(records, ranks, cfg)
    summary = summarize_tp(records)
    print_summary(summary, ".3g")
    if args.json:
        write_json(args.json, records, {"command": "bench tp", "where": where, "summary": summary})
        console.print(f"wrote {args.json}")
    return 0 if (summary.get("losses_agree_1e-4", True)
                 and summary.get("placement_losses_agree_1e-5", True)) else 1


def run_hetero(args: argparse.Namespace) -> int:
    ranks, hosts, link = resolve_placement(args)
    cfg = dataclass_from_args(HeteroBenchConfig, args, defaults=QUICK_HETERO if args.quick else None)
    cfg.check_world(ranks)
    cfg.check_placement(ranks, hosts)  # before the progress bar shows
    check_outputs(args, "json", "plot")
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

    print_table(f"heterogeneity on {ranks} ranks ({records[0]['link'] if records else ''}), "
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

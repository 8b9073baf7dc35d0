"""``plait bench tp``: plait's tensor parallelism against PyTorch's (DTensor), same model and
weights, step times and the losses compared."""

from __future__ import annotations

import argparse

from ..bench.config.tp import QUICK_TP, TPBenchConfig
from ..bench.report import (console, counted, human_bytes, print_summary, print_table,
                            progress_bar, write_json)
from .args import add_dataclass_args, dataclass_from_args
from .common import (DEFAULT_DEADLINE_S, add_launch_args, add_output_args, check_outputs,
                     resolve_placement)

__all__ = ["register", "run_tp"]

DESCRIPTION = ("The same model (plait's GPT, or --model hf-llama: a transformers Llama from a "
               "config), weights, batches and optimizer under plait (fused and plain) and "
               "torch.distributed.tensor.parallel; median step time, tokens/s and the largest "
               "loss difference.")


def register(parser, _rest=None) -> None:
    """Its flags: where it runs, what it writes, and TPBenchConfig's fields."""
    parser.description = DESCRIPTION
    add_launch_args(parser, deadline_s=DEFAULT_DEADLINE_S)
    add_output_args(parser)
    add_dataclass_args(parser, TPBenchConfig)
    parser.set_defaults(func=run_tp)


def _ms(t: float) -> str:
    return f"{t * 1e3:.1f}"


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
        print_table(f"tensor parallelism on {counted(ranks, 'rank')} ({link}): {_dense_title(gpt[0])}, "
                    f"batch {m['batch_size']}×{m['seq_len']}, {gpt[0]['optimizer']}",
                    ["system", "step (ms)", "tokens/s", "× pytorch-tp",
                     f"max |Δloss|, first {cfg.compare_steps} steps", "loss first → last"],
                    _tp_rows(gpt, "speedup_vs_pytorch_tp"), caption=caption + wire_note)
    if emb:
        m = emb[0]["model"]
        print_table(f"DLRM embeddings on {counted(ranks, 'rank')} ({link}): {m['tables']} tables × "
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
    from ..bench.tp import bench_tp, summarize_tp  # torch: once the flags have passed
    from ..bench.tp_dp import print_placements

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

"""``plait bench load``: each rank's peak memory while it loads only its share of a real
checkpoint (:mod:`plait.bench.load`), against the model's size and one process's whole load."""

from __future__ import annotations

import argparse

from ..bench.config.load import LoadBenchConfig
from ..bench.report import console, human_bytes, print_summary, print_table, write_json
from .args import add_dataclass_args, dataclass_from_args
from .common import check_outputs, positive_float

__all__ = ["register", "run_load"]

DESCRIPTION = (
    "Saves a transformers Llama of --size-gb GB of float32 weights with save_pretrained "
    "(sharded safetensors), then loads it whole in one process and with plait.from_pretrained "
    "on each of --worlds world sizes: every rank builds the model on the meta device and reads "
    "only its shards. Per rank: peak resident memory (the kernel's VmHWM) against the bound "
    "0.6 × the model's bytes + 0.5 GB, the memory before loading, its own tensors' bytes, the "
    "load's seconds, and the loss against the whole load's.")


def register(parser, _rest=None) -> None:
    parser.description = DESCRIPTION
    group = parser.add_argument_group("where it runs")
    group.add_argument("--timeout", type=positive_float, default=None,
                       help="seconds before any collective gives up (default 60)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="PATH", default=None, help="write the records as JSON")
    out.add_argument("--no-progress", action="store_true", help="no stage lines")
    add_dataclass_args(parser, LoadBenchConfig)
    parser.set_defaults(func=run_load)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def run_load(args: argparse.Namespace) -> int:
    cfg = dataclass_from_args(LoadBenchConfig, args)
    check_outputs(args, "json")
    from ..bench.load import bench_load  # torch: once the flags have passed

    stage = None if args.no_progress else (lambda text: console.print(f"[dim]{text}[/dim]"))
    records, summary = bench_load(cfg, timeout_s=args.timeout, on_stage=stage)
    rows = [[r["system"], str(r["world"]), str(r.get("rank", "–")),
             " ".join(map(str, r.get("kv_groups", []))) or "–", _gb(r["baseline_rss"]),
             _gb(r.get("own_bytes", r["model_bytes"])), _gb(r["peak_rss"]), _gb(r["bound_rss"]),
             "yes" if r["within_bound"] else "[red]no[/red]", f"{r['load_s']:.1f}",
             f"{r['loss']:.6f}", f"{r['loss_diff']:.1e}"] for r in records]
    print_table(f"loading a {human_bytes(summary['model_bytes'])} Llama "
                f"({summary['model']['num_hidden_layers']} layers, {summary['files']} files)",
                ["system", "ranks", "rank", "KV groups", "before (GB)", "own tensors (GB)",
                 "peak (GB)", "bound (GB)", "within", "load (s)", "loss", "Δ loss"], rows,
                caption="peak = the process's peak resident memory (VmHWM); before = resident "
                        "before loading (interpreter, torch, transformers); bound = 0.6 × the "
                        "model's bytes + 0.5 GB; Δ loss against the whole load in one process")
    print_summary(summary, ".3g")
    if args.json:
        write_json(args.json, records, {"command": "bench load", "summary": summary})
        console.print(f"wrote {args.json}")
    return 0

"""``plait bench tp``: plait's tensor parallelism against PyTorch's, training the same GPT
(or, ``--model hf-llama``, the same transformers Llama: :mod:`plait.bench.tp_hf`).

Every rank builds the same single-device GPT from the same seed, three times,
and makes each copy tensor-parallel another way:

- ``plait``: :func:`plait.nn.apply_tp`, fused compute–collective operators, the
  batch in ``microbatches`` interleaved micro-batches (default 2; 1: off);
- ``plait-plain``: the same layers with ``overlap=False`` (compute, then a
  blocking collective), so the reader sees how much of the gap is fusion;
- ``pytorch-tp``: ``torch.distributed.tensor.parallel.parallelize_module``
  over a 1-D ``DeviceMesh``: ``ColwiseParallel`` for the fused QKV and the
  MLP's fc, ``RowwiseParallel`` for the attention output and the MLP's proj
  (torchtitan's plan for a dense block, without sequence parallelism).

All three shard the same four linears per block by the same heads and
columns; embeddings, LayerNorms and the LM head stay replicated in all three.
They train on the same character batches with the same optimizer; the steps
are interleaved (step i of every system, in balanced orders, then step i + 1), so drift of a
shared machine hits them alike. Per step, each rank's wall time for forward,
backward and update, started together behind a barrier; a step takes as long
as its slowest rank; ``t_step_s`` is the median over the steps after warm-up.
``max_loss_diff``: the largest |loss − the reference's loss| over the first
``compare_steps`` steps (reference: ``pytorch-tp``; for ``pytorch-tp``
itself, ``plait``); ``max_loss_diff_timed`` the same over the timed steps.

PyTorch's Shard(0) of the fused QKV weight ``[3·D, D]`` is contiguous, which
would give rank 0 all of q and half of k. As torchtitan does with separate
wq/wk/wv, each rank must own whole heads of q, k and v: the rows are reordered
to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]`` (per rank, its heads of each) before
``parallelize_module``. The same function of the same weights; the GPT's
forward reads its head count from the local shape, as torchtitan's does.

With ``dp`` above 1 (``--dp 2 --tp 2``) the bench compares placements instead:
plait's tensor parallelism on the tp groups, PyTorch's data parallelism across
them, tp inside a host against tp across hosts, each beside the performance
model's prediction (:mod:`plait.bench.tp_dp`, :mod:`plait.perf.placement`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..models import GPT
from ..ops import explain, get_context
from ..runtime import parse_rate, rank_context
from ..runtime.priority import raise_comm_threads
from ..runtime.timing import agreed_max, balanced_round, median, time_once
from ..training.data import CharCorpus
from ..training.loop import Trainer
from ..training.models import build_gpt, gpt_loss, make_optimizer
from . import tp_hf
from .config.tp import COMPILED, DP_SYSTEMS, QUICK_TP, SYSTEMS, TPBenchConfig
from .tp_dlrm import EMB_SYSTEMS, PLAIT_EMB_SYSTEMS, run_emb_bench, torchrec_missing

__all__ = ["TPBenchConfig", "SYSTEMS", "DP_SYSTEMS", "QUICK_TP", "bench_tp", "run_tp_bench",
           "parallelize_torch_tp", "heads_contiguous_qkv", "summarize_tp"]


REFERENCE = "pytorch-tp"

NOTES = {
    "plait": "plait.nn.apply_tp: fused operators (column_parallel_matmul, matmul_all_reduce); "
             "with microbatches > 1 the batch's micro-batches take turns through the blocks, "
             "one's all-reduces on the wire while the next computes",
    "plait-plain": "plait.nn.apply_tp(overlap=False): compute, then a blocking all-reduce",
    "pytorch-tp": "parallelize_module with ColwiseParallel (qkv, fc) / RowwiseParallel (attn "
                  "proj, mlp proj) on a 1-D DeviceMesh; DTensor redistributes Partial→Replicate "
                  "with a blocking all-reduce after each row-parallel matmul (forward) and each "
                  "column-parallel input grad (backward): the same 4 all-reduces per block as "
                  "plait-plain, plus DTensor's per-op dispatch and sharding propagation",
}


# --- PyTorch tensor parallelism ---------------------------------------------

def heads_contiguous_qkv(qkv: nn.Linear, world: int) -> None:
    """Reorder a fused ``[q | k | v]`` linear's rows to ``[q_0 k_0 v_0 | q_1 k_1 v_1 | …]`` in place,
    so a contiguous Shard(0) over ``world`` ranks gives each rank whole heads of q, k and v."""
    rows = qkv.weight.shape[0]
    if rows % (3 * world):
        raise ValueError(f"qkv with {rows} rows does not split into 3 × {world} equal blocks")
    order = torch.arange(rows).view(3, world, rows // (3 * world)).transpose(0, 1).reshape(-1)
    with torch.no_grad():
        qkv.weight.copy_(qkv.weight[order])
        if qkv.bias is not None:
            qkv.bias.copy_(qkv.bias[order])


def parallelize_torch_tp(model: GPT, world: int | None = None) -> GPT:
    """``model`` made tensor-parallel by PyTorch (DTensor) over all ranks, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    world = world or dist.get_world_size()
    device = rank_context().topology.device
    mesh = init_device_mesh(device.type, (world,))
    plan = {}
    for i, block in enumerate(model.blocks):
        heads_contiguous_qkv(block.attn.qkv, world)
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(),
                     f"blocks.{i}.attn.proj": RowwiseParallel(),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
    return parallelize_module(model, mesh, plan)


# --- one rank -----------------------------------------------------------------

def _build(system: str, cfg: TPBenchConfig, vocab_size: int) -> nn.Module:
    if system in COMPILED:  # the same model, compiled (the first steps compile it)
        return torch.compile(_build(system.removesuffix("-compiled"), cfg, vocab_size))
    if cfg.model == "hf-llama":
        return tp_hf.build_hf(system, cfg, vocab_size)
    device = rank_context().topology.device
    if system == "pytorch-tp":
        torch.manual_seed(cfg.seed)  # what build_gpt seeds: the same initial weights
        model = GPT(cfg.train_config().gpt_config(vocab_size)).to(device)
        return parallelize_torch_tp(model)
    model = build_gpt(cfg.train_config(overlap=system == "plait"), vocab_size=vocab_size)
    return model.to(device)


def _train_interleaved(cfg: TPBenchConfig, built: dict, batches: list) -> dict:
    """Step i of every system, then step i + 1 (in balanced orders, so no system always goes
    first or always follows the same one): per system its losses and own step times."""
    ctx, device = rank_context(), rank_context().topology.device
    losses = {name: [] for name in built}
    times = {name: [] for name in built}
    names = list(built)
    for i, batch in enumerate(batches):
        for name in balanced_round(names, i):
            trainer = built[name]
            times[name].append(time_once(  # the loss read waits for the step to finish
                lambda: losses[name].append(trainer.step(i, batch)["loss"]), device))
        ctx.report({"part": cfg.model, "step": i, "of": len(batches)})
    return {"losses": losses, "times": times}


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def _record(name: str, cfg: TPBenchConfig, losses: dict, step_s: list[float],
            vocab_size: int) -> dict:
    ref = REFERENCE if name != REFERENCE else "plait"
    n = min(cfg.compare_steps, cfg.total_steps)
    diff = _max_diff(losses[name][:n], losses[ref][:n]) if ref in losses else None
    timed = (_max_diff(losses[name][cfg.warmup:], losses[ref][cfg.warmup:])
             if ref in losses else None)
    t_step = median(step_s[cfg.warmup:])
    tokens = cfg.batch_size * cfg.seq_len
    ctx, world = rank_context(), dist.get_world_size()
    wire = (tp_hf.hf_wire(cfg, world, ctx.link, vocab_size, name.removesuffix("-compiled"))
            if cfg.model == "hf-llama"
            else _wire(cfg, world, ctx.link))
    model = tp_hf.model_info(cfg, vocab_size)
    return {"system": name, "part": cfg.model, "t_step_s": t_step,
            "tokens_per_s": tokens / t_step, **wire,
            "max_loss_diff": diff, "loss_diff_vs": ref if diff is not None else None,
            "compare_steps": n, "max_loss_diff_timed": timed,
            "losses": losses[name], "step_times_s": step_s,
            "tokens_per_step": tokens, "world_size": world, "model": model,
            "microbatches": cfg.microbatches if name == "plait" and cfg.model == "gpt" else 1,
            "optimizer": cfg.optimizer, "lr": cfg.lr, "warmup": cfg.warmup, "steps": cfg.steps,
            "note": _note(name, cfg),
            "link": ctx.link, "backend": ctx.topology.backend, **cfg.extra}


def _note(name: str, cfg: TPBenchConfig) -> str:
    notes = tp_hf.NOTES if cfg.model == "hf-llama" else NOTES
    if name in COMPILED:
        return notes[name.removesuffix("-compiled")] + "; the model under torch.compile (inductor)"
    return notes[name]


def _wire(cfg: TPBenchConfig, world: int, link: str) -> dict:
    """What every system sends per step: 2 all-reduces of [B, S, D] fp32 per block forward
    (after attn proj and mlp proj) and 2 backward (the input grads of qkv and fc), and the
    time that takes at the link rate with the ring's 2(n−1)/n bus factor: a lower bound on
    the communication, which fusion can hide but not remove."""
    buf = cfg.batch_size * cfg.seq_len * cfg.n_embd * 4
    count = 4 * cfg.n_layer
    rate = parse_rate(link)
    wire = count * buf * 2 * (world - 1) / world
    return {"allreduce_per_step": count, "allreduce_bytes": buf,
            "t_comm_link_s": wire * 8 / rate if rate else None}


def run_tp_bench(cfg: TPBenchConfig) -> list[dict]:
    """On every rank of an initialised group: build, train interleaved, one record per system
    (with ``dp`` above 1, per system and placement: :mod:`plait.bench.tp_dp`)."""
    cfg = cfg.resolved(dist.get_world_size())
    if cfg.dp > 1:
        from .tp_dp import run_placement_bench

        return run_placement_bench(cfg)
    get_context().calibration()  # once, before anything is timed
    corpus = CharCorpus.load()
    stream = corpus.batches("train", cfg.batch_size, cfg.seq_len, seed=cfg.seed + 1)
    device = rank_context().topology.device
    batches = [tuple(t.to(device) for t in next(stream)) for _ in range(cfg.total_steps)]
    built = {}
    loss_fn = tp_hf.llama_loss if cfg.model == "hf-llama" else gpt_loss
    for name in cfg.systems:  # a constant learning rate: no schedule
        model = _build(name, cfg, corpus.vocab_size)
        built[name] = Trainer(model, make_optimizer(model, cfg.lr, cfg.optimizer), loss_fn)
    # the same priority for every group's transfer threads, whoever made the group (the
    # DeviceMesh's own, if it made one, as well as plait's): runtime.priority
    raise_comm_threads()
    run = _train_interleaved(cfg, built, batches)
    records = [_record(name, cfg, run["losses"], agreed_max(run["times"][name]),
                       corpus.vocab_size) for name in cfg.systems]
    paths = explain().splitlines()
    for r in records:
        if r["system"] == "plait":
            r["paths"] = paths
        if cfg.model == "hf-llama":
            r["split_modules"] = tp_hf.split_modules(built[r["system"]].model)
    return _with_speedups(records, REFERENCE) + (_dlrm_records(cfg) if cfg.runs_dlrm else [])


def _dlrm_records(cfg: TPBenchConfig) -> list[dict]:
    """plait's two embedding paths always; TorchRec beside them where it imports, else a
    record that says why not."""
    missing = torchrec_missing()
    systems = EMB_SYSTEMS if missing is None else PLAIT_EMB_SYSTEMS
    records = _with_speedups(run_emb_bench(cfg.emb_config(), cfg.warmup, cfg.steps,
                                           cfg.compare_steps, systems), "torchrec")
    return records + ([] if missing is None else [_torchrec_skipped(missing)])


def _torchrec_skipped(missing: str) -> dict:
    return {"system": "torchrec", "part": "dlrm", "skipped": missing, "t_step_s": None,
            "tokens_per_s": None, "max_loss_diff": None}


def _with_speedups(records: list[dict], reference: str) -> list[dict]:
    by = {r["system"]: r for r in records}
    key = f"speedup_vs_{reference.replace('-', '_')}"
    for r in records:
        r.setdefault("part", "gpt" if reference == REFERENCE else "dlrm")
        r["speedup_vs"] = reference if reference in by else None
        r[key] = by[reference]["t_step_s"] / r["t_step_s"] if reference in by else None
    return records


def summarize_tp(records: list[dict]) -> dict:
    """What the issue asks: plait's speedup over PyTorch TP, and whether the losses agree."""
    by = {r["system"]: r for r in records if r.get("part") not in ("dlrm", "placement")}
    emb = {r["system"]: r for r in records if r.get("part") == "dlrm"}
    out = {}
    if any(r.get("part") == "placement" for r in records):
        from .tp_dp import summarize_placements

        out.update(summarize_placements(records))
    if "torchrec" in emb and emb["torchrec"].get("skipped"):
        out["torchrec"] = "skipped: " + emb["torchrec"]["skipped"]
    elif "torchrec" in emb and "plait-emb" in emb:
        out["plait_emb_speedup_vs_torchrec"] = emb["plait-emb"]["speedup_vs_torchrec"]
    if emb.get("plait-emb", {}).get("max_loss_diff") is not None:  # vs TorchRec, else plain
        out["emb_max_loss_diff"] = emb["plait-emb"]["max_loss_diff"]
        out["emb_loss_diff_vs"] = emb["plait-emb"]["loss_diff_vs"]
    if "plait-emb" in emb and "plait-emb-plain" in emb:
        out["emb_fusion_speedup"] = emb["plait-emb-plain"]["t_step_s"] / emb["plait-emb"]["t_step_s"]
    if "plait" in by and REFERENCE in by:
        out["plait_microbatches"] = by["plait"].get("microbatches")
        out["plait_speedup_vs_pytorch_tp"] = by["plait"]["speedup_vs_pytorch_tp"]
        out["max_loss_diff"] = by["plait"]["max_loss_diff"]
        out["losses_agree_1e-4"] = by["plait"]["max_loss_diff"] <= 1e-4
        out["max_loss_diff_timed"] = max(by[s]["max_loss_diff_timed"] for s in by
                                         if s != REFERENCE)
        out["timed_losses_agree_1e-5"] = out["max_loss_diff_timed"] <= 1e-5
    if "plait-plain" in by and REFERENCE in by:
        out["plait_plain_speedup_vs_pytorch_tp"] = by["plait-plain"]["speedup_vs_pytorch_tp"]
    if "plait" in by and "plait-plain" in by:
        out["fusion_speedup"] = by["plait-plain"]["t_step_s"] / by["plait"]["t_step_s"]
    if "plait-compiled" in by:  # compiled plait's step over eager plait's and compiled DTensor's
        step = by["plait-compiled"]["t_step_s"]
        for other in ("plait", "pytorch-tp-compiled"):
            if other in by:
                out[f"plait_compiled_over_{other.replace('-', '_')}"] = step / by[other]["t_step_s"]
        out["plait_compiled_max_loss_diff"] = by["plait-compiled"]["max_loss_diff"]
    return out


def bench_tp(cfg: TPBenchConfig, *, ranks: int, hosts: int = 0, link: str | None = "1gbit",
             timeout_s: float | None = None, on_progress=None) -> tuple[list[dict], str]:
    """The comparison on ``ranks`` local ranks (``hosts`` emulated hosts; 0: loopback)."""
    from ..runtime.placement import run_placed

    cfg = cfg.resolved(ranks)
    return run_placed(run_tp_bench, cfg, ranks=ranks, hosts=hosts, link=link,
                      timeout_s=timeout_s, on_progress=on_progress)

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

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn as nn

from ..runtime.fields import help_meta as _h
from ..models import GPT
from ..ops import explain, get_context
from ..runtime import parse_rate, rank_context
from ..runtime.priority import raise_comm_threads
from ..runtime.timing import agreed_max, balanced_round, median, time_once
from ..training.config import TrainConfig
from ..training.data import CharCorpus
from ..training.loop import Trainer
from ..training.models import build_gpt, gpt_loss, make_optimizer
from . import tp_hf
from .tp_dlrm import EMB_SYSTEMS, PLAIT_EMB_SYSTEMS, EmbBenchConfig, run_emb_bench, torchrec_missing

__all__ = ["TPBenchConfig", "SYSTEMS", "DP_SYSTEMS", "QUICK_TP", "bench_tp", "run_tp_bench",
           "parallelize_torch_tp", "heads_contiguous_qkv", "summarize_tp"]

SYSTEMS = ("plait", "plait-plain", "pytorch-tp")
COMPILED = ("plait-compiled", "pytorch-tp-compiled")  # --compile: the two under torch.compile
DP_SYSTEMS = ("plait", "plait-plain")  # under --dp above 1
MODELS = ("gpt", "hf-llama")
# per model where they differ: the GPT bench's sizes; the Llama of issue 23 (4 layers of
# width 256), whose all-reduces are a larger share of a step than the 2 × 512 GPT's
SIZES = {"gpt": dict(n_layer=2, n_embd=512), "hf-llama": dict(n_layer=4, n_embd=256)}
REFERENCE = "pytorch-tp"
QUICK_TP = dict(batch_size=8, warmup=2, steps=8)

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



@dataclass(frozen=True, kw_only=True)
class TPBenchConfig:
    """The model, the data and the steps; each field's help is its CLI flag's help."""

    systems: tuple[str, ...] = field(default=SYSTEMS, metadata=_h(
        "what to train: " + ", ".join(SYSTEMS + COMPILED)))
    compile: bool = field(default=False, metadata=_h(
        "hf-llama: also train plait-compiled and pytorch-tp-compiled, the same models under "
        "torch.compile (inductor; compiled in the warm-up steps)"))
    model: str = field(default="gpt", metadata=_h(
        "gpt (plait's GPT) or hf-llama (a transformers LlamaForCausalLM from a config, "
        "grouped-query attention, no download; needs plait[hf])"))
    n_layer: int | None = field(default=None, metadata=_h(
        "transformer blocks (default: 2 for gpt, 4 for hf-llama)"))
    n_head: int = field(default=8, metadata=_h("attention heads"))
    n_kv_head: int = field(default=2, metadata=_h("hf-llama: key/value heads (grouped-query)"))
    n_embd: int | None = field(default=None, metadata=_h(
        "model width (default: 512 for gpt, 256 for hf-llama)"))
    hf_plan: str = field(default="auto", metadata=_h(
        "hf-llama: auto (the model's own plan, embedding and LM head split by vocabulary too) "
        "or layers (the decoder layers' entries only; embedding and LM head replicated)"))
    seq_len: int = field(default=128, metadata=_h("characters per sequence"))
    batch_size: int = field(default=16, metadata=_h("sequences per step (the same on every rank)"))
    warmup: int = field(default=3, metadata=_h("untimed steps first (they still train)"))
    steps: int = field(default=12, metadata=_h("timed steps (median reported)"))
    compare_steps: int = field(default=5, metadata=_h("steps over which losses are compared"))
    lr: float = field(default=1e-3, metadata=_h("learning rate (constant)"))
    optimizer: str = field(default="adamw", metadata=_h("adamw (weight decay 0) or sgd"))
    seed: int = field(default=0, metadata=_h("seed of the weights and the data order"))
    microbatches: int = field(default=2, metadata=_h(
        "gpt's plait: micro-batches interleaved, one's all-reduces under the next one's compute "
        "(1: off; plait.nn.apply_tp(microbatches=))"))
    dlrm: bool = field(default=True, metadata=_h(
        "(--model gpt) also DLRM embeddings: plait's ShardedEmbeddingBag, fused and plain, "
        "against each other and TorchRec's sharded EmbeddingBagCollection (TorchRec skipped, "
        "with the reason, where it does not import)"))
    emb_tables: int = field(default=4, metadata=_h("DLRM: tables (whole tables per rank)"))
    emb_rows: int = field(default=50_000, metadata=_h("DLRM: rows per table"))
    emb_dim: int = field(default=64, metadata=_h("DLRM: embedding dim"))
    emb_batch: int = field(default=4096, metadata=_h("DLRM: bags per table per step"))
    emb_pool: int = field(default=8, metadata=_h("DLRM: ids per bag"))
    emb_lr: float = field(default=20_000.0, metadata=_h(
        "DLRM: SGD learning rate (the loss is a mean over batch × tables × dim elements)"))
    emb_chunks: int = field(default=0, metadata=_h(
        "DLRM: plait-emb's pieces (0: auto, the cost model's choice)"))
    dp: int = field(default=1, metadata=_h(
        "data-parallel replicas (PyTorch's DDP or FSDP2 around plait's TP); above 1 the bench "
        "trains plait's fused path (--systems plait, plait-plain) under both placements, tp "
        "inside a host and tp across hosts, and prints each beside the simulator's prediction"))
    tp: int | None = field(default=None, metadata=_h(
        "ranks in one tensor-parallel group; --dp × --tp must be the ranks (default: ranks / "
        "--dp)"))
    extra: dict = field(default_factory=dict)  # where it ran (filled by the launcher)

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r}: choose from {', '.join(MODELS)}")
        for name, value in SIZES[self.model].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        unknown = [s for s in self.systems if s not in SYSTEMS + COMPILED]
        if unknown or not self.systems:
            raise ValueError(f"--systems {list(self.systems)}: choose from "
                             f"{list(SYSTEMS + COMPILED)}")
        if self.compile or set(self.systems) & set(COMPILED):
            if self.model != "hf-llama":
                raise ValueError("--compile trains the transformers Llama: give --model hf-llama")
            more = tuple(s for s in COMPILED if s not in self.systems) if self.compile else ()
            object.__setattr__(self, "systems", (*self.systems, *more))
        sizes = {k: getattr(self, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd",
                                               "seq_len", "batch_size", "steps",
                                               "compare_steps")}
        if min(sizes.values()) < 1 or self.warmup < 0 or self.lr <= 0:
            raise ValueError(f"sizes and steps must be positive, warmup ≥ 0, lr > 0: "
                             f"{sizes}, warmup {self.warmup}, lr {self.lr}")
        for name in ("emb_tables", "emb_rows", "emb_dim", "emb_batch", "emb_pool"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got "
                                 f"{getattr(self, name)}")
        if self.emb_chunks < 0:
            raise ValueError(f"--emb-chunks must be ≥ 0 (0: auto), got {self.emb_chunks}")
        if self.optimizer not in ("adamw", "sgd"):
            raise ValueError(f"--optimizer must be adamw or sgd, got {self.optimizer!r}")
        self.train_config().gpt_config(97)  # refuse n_embd not divisible by n_head now
        self._check_mesh()
        if self.model == "hf-llama":
            self._check_hf()

    def _check_mesh(self) -> None:
        for name in ("dp", "tp"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name} must be a positive integer, got {value!r}")
        if self.dp == 1:
            return
        if self.systems == SYSTEMS:  # the default: the placements of plait's fused path
            object.__setattr__(self, "systems", ("plait",))
        if not set(self.systems) <= set(DP_SYSTEMS):
            raise ValueError(f"--dp {self.dp} compares placements of {' and '.join(DP_SYSTEMS)}, "
                             f"not --systems {','.join(self.systems)}")
        if self.batch_size % self.dp:
            raise ValueError(f"--batch-size {self.batch_size} does not split evenly over --dp "
                             f"{self.dp} replicas")

    @property
    def mesh_ranks(self) -> int | None:
        """--dp × --tp where --tp is given (the ranks the run needs), else None."""
        return self.dp * self.tp if self.tp is not None else None

    def resolved(self, world: int) -> "TPBenchConfig":
        """This config on ``world`` ranks, ``tp`` filled in (checked by :meth:`check_world`)."""
        self.check_world(world)
        return replace(self, tp=world // self.dp)

    def _check_hf(self) -> None:
        if self.n_head % self.n_kv_head:
            raise ValueError(f"--n-head {self.n_head} is not a multiple of --n-kv-head "
                             f"{self.n_kv_head} (grouped-query attention)")
        if self.hf_plan not in tp_hf.HF_PLANS:
            raise ValueError(f"--hf-plan {self.hf_plan!r}: choose from "
                             f"{', '.join(tp_hf.HF_PLANS)}")
        missing = tp_hf.transformers_missing()
        if missing is not None:
            raise ValueError(f"--model hf-llama needs transformers (pip install 'plait[hf]'): "
                             f"{missing}")

    @property
    def runs_dlrm(self) -> bool:
        return self.dlrm and self.model == "gpt" and self.dp == 1

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def train_config(self, overlap: bool = True) -> TrainConfig:
        return TrainConfig(model="gpt", steps=self.total_steps, batch_size=self.batch_size,
                           lr=self.lr, seq_len=self.seq_len, n_layer=self.n_layer,
                           n_head=self.n_head, n_embd=self.n_embd, overlap=overlap, seed=self.seed,
                           microbatches=self.microbatches if overlap else 1)

    def emb_config(self) -> EmbBenchConfig:
        return EmbBenchConfig(tables=self.emb_tables, rows=self.emb_rows, dim=self.emb_dim,
                              batch=self.emb_batch, pool=self.emb_pool, lr=self.emb_lr,
                              seed=self.seed, chunks=self.emb_chunks or "auto")

    def check_world(self, world: int) -> None:
        tp = self.tp if self.tp is not None else world // self.dp
        if self.dp * tp != world:
            raise ValueError(f"--dp {self.dp} × --tp {tp} = {self.dp * tp} ranks, but the run "
                             f"has {world} (--ranks, or --hosts)")
        if self.dp > 1:
            self._check_tp(tp)
            return
        if self.runs_dlrm and self.emb_tables % world:
            raise ValueError(f"--emb-tables {self.emb_tables} do not split evenly over {world} "
                             "ranks (TorchRec's table-wise plan and plait's are compared as equals)")
        if self.n_head % world:
            raise ValueError(f"--n-head {self.n_head} does not split over {world} ranks: PyTorch "
                             "TP shards evenly, so the head count must be a multiple of the ranks")
        if self.model == "hf-llama" and self.n_kv_head % world:
            raise ValueError(f"--n-kv-head {self.n_kv_head} does not split over {world} ranks: "
                             "PyTorch TP shards k_proj/v_proj evenly, so the KV-head count "
                             "must be a multiple of the ranks")


    def _check_tp(self, tp: int) -> None:
        if tp < 2:
            raise ValueError(f"--dp {self.dp} × --tp {tp}: with one rank per tp group both "
                             "placements are the same; the comparison needs --tp 2 or more")
        if self.n_head % tp:
            raise ValueError(f"--n-head {self.n_head} does not split over --tp {tp} ranks")
        if self.model == "hf-llama" and self.n_kv_head % tp:
            raise ValueError(f"--n-kv-head {self.n_kv_head} does not split over --tp {tp} ranks")


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

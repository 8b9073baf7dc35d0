"""Per-operation costs of one training step, at the reference GPU's speed.

Turns a SimConfig into the durations the simulator schedules: compute
(roofline, compute.py) and collectives (alpha-beta, collectives.py) for one
layer's forward and backward, the parameter/gradient traffic of data
parallelism, and the fused-operator pairs (a computation and the collective
that depends on it) with the piece count ``chunks="auto"`` would pick.

Transformer layer per rank, tokens T = local_batch * seq_len, sequence
parallel (Megatron-style, as torchtitan's TP):
    AG [T, h] -> QKV [T, h] @ [h, (h + 2 kv)/tp]        (all_gather_matmul)
    attention core 4 T S h / tp * 1/2 (causal)
    O [T, h/tp] @ [h/tp, h] -> RS [T, h]                 (matmul_reduce_scatter)
    AG [T, h] -> up [T, h] @ [h, g ffn/tp], g = 2 SwiGLU (all_gather_matmul)
    down [T, ffn/tp] @ [ffn/tp, h] -> RS [T, h]          (matmul_reduce_scatter)
Backward: each pair mirrored (dgrad GEMM with the opposite collective) plus
wgrad GEMMs of the same FLOPs; ``recompute`` x forward again.
MoE replaces the MLP: dispatch all_to_all -> expert GEMMs -> combine all_to_all.
DLRM: pooled embedding lookup -> all_to_all (embedding_all_to_all), MLPs
data-parallel, and the mirror in backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .collectives import hierarchical_time, piece_latency
from .compute import embedding_bag_time, gemm_flops, gemm_time, roofline_time
from .config import SimConfig
from .hardware import Accelerator, dtype_bytes, get_accelerator, get_link
from .pipeline import DEFAULT_MIN_PIECE_BYTES, best_chunks

__all__ = ["Pair", "Workload", "build_workload", "group_layout", "AXES"]

AXES = {"dp": 0, "ep": 1, "tp": 2}
_TRAIN_BYTES_PER_PARAM = 16  # bf16 param + grad, fp32 master + two Adam moments


@dataclass(frozen=True)
class Pair:
    """A computation and its dependent collective on ``axis`` (a fusable operator)."""

    name: str
    t_compute_s: float
    t_comm_s: float
    comm_latency_s: float
    axis: str
    chunks: int = 1  # pieces chunks="auto" picks (1 = not worth fusing)


@dataclass
class Workload:
    """Durations of one step's operations at speed 1 (see module doc)."""

    kind: str
    layers: int
    fwd: list = field(default_factory=list)        # Pair or ("compute", s) in program order
    bwd: list = field(default_factory=list)
    fsdp_gather_s: float = 0.0                     # per layer, background, dp axis
    grad_sync_s: float = 0.0                       # per layer, background, dp axis
    step_compute_s: float = 0.0                    # head/loss/optimizer, once per step
    balance_axis: str | None = None
    move_s_per_share: float = 0.0                  # migrating all of a group's shards
    samples_per_step: float = 0.0                  # tokens (transformers) or samples (dlrm)
    flops_per_step: float = 0.0                    # per rank, for MFU


def group_layout(axis: str, sim: SimConfig) -> tuple[int, int]:
    """(members per node, nodes spanned) of one group along ``axis``."""
    par, gpn = sim.parallel, sim.cluster.gpus_per_node
    size = {"tp": par.tp, "ep": par.ep, "dp": par.dp}[axis]
    stride = {"tp": 1, "ep": par.tp, "dp": par.tp * par.ep}[axis]
    local = min(size, max(1, gpn // stride)) if stride < gpn else 1
    return local, math.ceil(size / local)


class _Costs:
    def __init__(self, sim: SimConfig):
        self.sim = sim
        self.acc: Accelerator = get_accelerator(sim.cluster.gpu)
        self.intra = get_link(sim.cluster.intra_link)
        self.inter = get_link(sim.cluster.inter_link)
        self.dtype = sim.model.dtype
        self.dsize = dtype_bytes(self.dtype)
        self.overhead = (sim.per_piece_overhead_s if sim.per_piece_overhead_s is not None
                         else 2 * self.acc.launch_s)

    def gemm(self, m, k, n) -> float:
        return gemm_time(m, k, n, self.acc, self.dtype)

    def comm(self, collective: str, nbytes: float, axis: str) -> float:
        local, nodes = group_layout(axis, self.sim)
        return hierarchical_time(collective, nbytes, local=local, nodes=nodes,
                                 intra=self.intra, inter=self.inter)

    def pair(self, name: str, tc: float, collective: str, nbytes: float, axis: str) -> Pair:
        tm = self.comm(collective, nbytes, axis)
        local, nodes = group_layout(axis, self.sim)
        if collective == "all_to_all":
            lat = piece_latency(collective, local * nodes, self.inter if nodes > 1 else self.intra)
        else:
            lat = self.comm(collective, 0.0, axis)
        if self.sim.chunks is not None:  # a system with a fixed decomposition
            return Pair(name, tc, tm, lat, axis, self.sim.chunks)
        max_p = min(self.sim.max_chunks, max(1, int(nbytes // DEFAULT_MIN_PIECE_BYTES)))
        p, t = best_chunks(tc, tm, self.overhead, max_chunks=max_p, comm_latency_s=lat)
        if t >= 0.98 * (tc + tm):  # chunks="auto" keeps the plain path below 2 % gain
            p = 1
        return Pair(name, tc, tm, lat, axis, p)


@dataclass
class _Block:
    """One sub-layer: forward and backward ops, per-rank parameters and forward FLOPs."""

    fwd: list
    bwd: list
    params: float
    flops: float


def _attention(c: _Costs, T: int, act: float) -> _Block:
    m, tp, h, d = c.sim.model, c.sim.parallel.tp, c.sim.model.hidden, c.dsize
    kv = h // m.heads * m.kv_heads
    core_flops = 4 * T * m.seq_len * h / tp * 0.5  # QK^T and PV, causal
    core = roofline_time(core_flops, 4 * T * h / tp * d, c.acc, c.dtype,
                         flops_rate=c.acc.flops(c.dtype) * c.acc.attention_efficiency)
    elem = roofline_time(0.0, 16 * act / tp, c.acc, c.dtype, launches=6)  # norms, rope, residual
    qkv, out = c.gemm(T, h, (h + 2 * kv) // tp), c.gemm(T, h // tp, h)
    fwd = [c.pair("ag_qkv", qkv, "all_gather", act, "tp"), ("compute", core + elem),
           c.pair("out_rs", out, "reduce_scatter", act, "tp")]
    bwd = [("compute", qkv + out + 2.5 * core + elem),  # wgrad GEMMs + attention backward
           c.pair("ag_out_dgrad", out, "all_gather", act, "tp"),
           c.pair("qkv_dgrad_rs", qkv, "reduce_scatter", act, "tp")]
    flops = gemm_flops(T, h, (h + 2 * kv) / tp) + gemm_flops(T, h / tp, h) + core_flops
    return _Block(fwd, bwd, (h * (h + 2 * kv) + h * h) / tp, flops)


def _dense_mlp(c: _Costs, T: int, act: float) -> _Block:
    m, tp, h = c.sim.model, c.sim.parallel.tp, c.sim.model.hidden
    g = 2 if m.swiglu else 1
    up, down = c.gemm(T, h, g * m.ffn // tp), c.gemm(T, m.ffn // tp, h)
    elem = roofline_time(0.0, 8 * act / tp, c.acc, c.dtype, launches=3)
    fwd = [c.pair("ag_up", up, "all_gather", act, "tp"), ("compute", elem),
           c.pair("down_rs", down, "reduce_scatter", act, "tp")]
    bwd = [("compute", up + down + 2 * elem),  # wgrad GEMMs: not overlapped in either path
           c.pair("ag_down_dgrad", down, "all_gather", act, "tp"),
           c.pair("up_dgrad_rs", up, "reduce_scatter", act, "tp")]
    return _Block(fwd, bwd, (g + 1) * h * m.ffn / tp, (g + 1) * gemm_flops(T, h, m.ffn / tp))


def _moe_mlp(c: _Costs, T: int) -> _Block:
    m, par, h = c.sim.model, c.sim.parallel, c.sim.model.hidden
    g = 2 if m.swiglu else 1
    rows = T // par.tp * m.top_k  # token copies each rank's experts see, balanced routing
    up, down = c.gemm(rows, h, g * m.ffn), c.gemm(rows, m.ffn, h)
    a2a = rows * h * c.dsize
    router = c.gemm(T // par.tp, h, m.experts)
    fwd = [("compute", router), c.pair("a2a_up", up, "all_to_all", a2a, "ep"),
           c.pair("down_a2a", down, "all_to_all", a2a, "ep")]
    bwd = [("compute", up + down + 2 * router),
           c.pair("a2a_down_dgrad", down, "all_to_all", a2a, "ep"),
           c.pair("up_dgrad_a2a", up, "all_to_all", a2a, "ep")]
    params = m.experts // par.ep * (g + 1) * h * m.ffn  # experts are whole on their rank
    return _Block(fwd, bwd, params, (g + 1) * gemm_flops(rows, h, m.ffn))


def _transformer(c: _Costs, w: Workload) -> None:
    m, par = c.sim.model, c.sim.parallel
    T = m.local_batch * m.seq_len
    act = T * m.hidden * c.dsize  # [T, h]: all-gather output / reduce-scatter input
    attn = _attention(c, T, act)
    mlp = _moe_mlp(c, T) if m.kind == "moe" else _dense_mlp(c, T, act)
    fwd = attn.fwd + mlp.fwd
    recompute = [_recomputed(x, m.recompute) for x in fwd] if m.recompute > 0 else []
    w.fwd, w.bwd = fwd, recompute + mlp.bwd + attn.bwd
    shard = attn.params + mlp.params  # per rank, per layer
    _data_parallel(c, w, shard)
    head = 3 * c.gemm(T, m.hidden, m.vocab // par.tp)
    w.step_compute_s = head + _optimizer(c, shard * m.layers)
    w.samples_per_step = T * par.dp
    w.flops_per_step = ((3 + m.recompute) * (attn.flops + mlp.flops) * m.layers
                        + 3 * gemm_flops(T, m.hidden, m.vocab / par.tp))
    w.balance_axis = "tp" if par.tp > 1 else ("ep" if par.ep > 1 else None)
    link = c.intra if par.tp <= c.sim.cluster.gpus_per_node else c.inter
    # exact migration moves parameters with their gradients and optimizer state
    w.move_s_per_share = (shard * par.tp * m.layers * _TRAIN_BYTES_PER_PARAM / link.effective_bw_Bps
                          / (par.dp if par.fsdp else 1))


def _recomputed(op, frac: float):
    """``frac`` of a forward op again; collectives only under full recomputation
    (selective schemes, Megatron's and torchtitan's op-level SAC, keep them)."""
    if isinstance(op, tuple):
        return (op[0], op[1] * frac)
    if frac >= 1.0:
        return Pair(op.name + "_re", op.t_compute_s, op.t_comm_s, op.comm_latency_s, op.axis, op.chunks)
    return ("compute", op.t_compute_s * frac)


def _data_parallel(c: _Costs, w: Workload, shard_params: float) -> None:
    """Per-layer background traffic over dp: FSDP gathers + scatters, or DDP all-reduce."""
    par = c.sim.parallel
    if par.dp == 1:
        return
    if par.fsdp:
        w.fsdp_gather_s = c.comm("all_gather", shard_params * c.dsize, "dp")
        w.grad_sync_s = c.comm("reduce_scatter", shard_params * 4, "dp")  # fp32 gradient reduce
    else:
        w.grad_sync_s = c.comm("all_reduce", shard_params * c.dsize, "dp")


def _optimizer(c: _Costs, params_per_rank: float) -> float:
    shard = params_per_rank / (c.sim.parallel.dp if c.sim.parallel.fsdp else 1)
    return roofline_time(0.0, shard * 2 * _TRAIN_BYTES_PER_PARAM, c.acc, "fp32")


def _mlp(c: _Costs, rows: int, widths) -> tuple[float, float, float]:
    """(forward seconds, FLOPs, params) of a stack of dense layers."""
    t = f = p = 0.0
    for k, n in zip(widths[:-1], widths[1:]):
        t += c.gemm(rows, k, n)
        f += gemm_flops(rows, k, n)
        p += k * n
    return t, f, p


def _dlrm(c: _Costs, w: Workload) -> None:
    m, n = c.sim.model, c.sim.parallel.dp
    b, dim, d = m.local_batch, m.embedding_dim, c.dsize
    lookups = m.tables * b * m.pooling  # per rank on average (tables x global batch / n)
    emb = embedding_bag_time(lookups=lookups, dim=dim, acc=c.acc, dtype=m.dtype, bags=m.tables * b)
    a2a = m.tables * b * dim * d  # pooled outputs this rank sends
    feats = m.tables + 1
    inter_in = feats * (feats - 1) // 2 + dim
    bot_t, bot_f, bot_p = _mlp(c, b, (m.dense_features, *m.bottom_mlp[:-1], dim))
    top_t, top_f, top_p = _mlp(c, b, (inter_in, *m.top_mlp))
    inter_t = c.gemm(b * feats, dim, feats)
    w.fwd = [("dense", bot_t), c.pair("emb_a2a", emb, "all_to_all", a2a, "dp"),
             ("dense", inter_t + top_t)]
    w.bwd = [("dense", 2 * (top_t + inter_t)), c.pair("a2a_emb_bwd", 2 * emb, "all_to_all", a2a, "dp"),
             ("dense", 2 * bot_t)]
    dense_p = bot_p + top_p
    w.grad_sync_s = c.comm("all_reduce", dense_p * 4, "dp") if n > 1 else 0.0
    w.step_compute_s = roofline_time(0.0, dense_p * 2 * _TRAIN_BYTES_PER_PARAM, c.acc, "fp32")
    w.samples_per_step = b * n
    w.flops_per_step = 3 * (bot_f + top_f + gemm_flops(b * feats, dim, feats))
    w.balance_axis = "dp" if n > 1 else None
    rows_bytes = m.tables / n * 1e6 * dim * d * 3  # ~1M rows per table, weights + Adagrad state
    w.move_s_per_share = rows_bytes * n / c.inter.effective_bw_Bps


def build_workload(sim: SimConfig) -> Workload:
    """Durations of every operation of one step of ``sim``'s model."""
    c = _Costs(sim)
    w = Workload(kind=sim.model.kind, layers=1 if sim.model.kind == "dlrm" else sim.model.layers)
    (_dlrm if sim.model.kind == "dlrm" else _transformer)(c, w)
    return w

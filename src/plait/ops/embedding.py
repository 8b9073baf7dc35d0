"""Pooled embedding lookups + All-to-All: the model-parallel embeddings of DLRM.

``embedding_all_to_all``: ``out_r[b, t] = embedding_bag(table_t, bag B₀ᵣ + b)`` for every
table t of every rank, i.e. ``all_to_all(stack_t embedding_bag(table_t, whole batch))``.

Each rank owns whole tables and pools them for the whole global batch; the
exchange leaves every rank its batch slice of every table.

=========  ==========================  ===============================================
tensor     shape on rank r             note
=========  ==========================  ===============================================
tables     T_r × [N_t, D]              T_r ≥ 1 and N_t may differ per rank; D shared
indices    T_r × [nnz_t]               whole global batch; int64 or int32
offsets    T_r × [B]                   bag starts (EmbeddingBag, include_last_offset=False)
out        [B_r, T, D]                 T = Σ_s T_s, tables by owner rank, then local
                                       order; B_r = batch_sizes[r] (default even)
=========  ==========================  ===============================================

Backward: no dgrad (indices); wgrad ``dW_t[i] += g[b, t]`` for every index i of bag b
(``/ |bag b|`` for mode="mean"). Fused too: each rank's gradient slice goes back to
the table owners piece by piece, and each arriving piece's ``index_add_`` runs as
soon as it lands, in a fixed order (own rows, then pieces in order, sources in
rank order), so repeated runs agree bit for bit. (On CUDA ``index_add_`` uses
atomics; set ``torch.use_deterministic_algorithms(True)`` for the same promise.)

Schedule. The output is laid out ``[T, B_r, D]`` and returned as its ``[B_r, T, D]`` view.
Every destination's rows are cut into the same number of pieces; piece j's pooled rows for
every destination go into one send buffer and its all_to_all starts while piece j+1 is
computed; this rank's own rows are pooled straight into the output after the last piece has
started. One piece is the plain path. A bag's pooled value does not depend on which other
bags one ``embedding_bag`` call holds, so every path is bit-identical to the plain one.

Checks. Before any data moves, one small exchange per call (``ctx.gather_meta``: an
all_gather on gloo, one header-only call on shared memory) carries every
rank's dtype, D, batch, mode, chunks, batch_sizes, table count, lookups (for
``chunks="auto"``) and its verdict on its own input (index ranges, offsets,
dtypes), so bad input on any rank raises on every rank. ``ctx.validate`` does not
turn it off: the layout needs every rank's table count. The value checks read
every index and offset once (one host sync per table on CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .agree import Check, check_chunks, check_same, chunks_code, dtype_code
from .context import OpsContext, attempt, get_context, transport_of
from ..perf.pieces import Work
from .exchange import start_all_to_all
from .library import group_key, group_of, opaque, opaque_key
from .pieces import check_float, even_sizes, offsets, row_parts

__all__ = ["embedding_all_to_all", "EmbeddingCheck"]

_MODES = {"sum": 0, "mean": 1}
_INDEX_DTYPES = {torch.int64: 0, torch.int32: 1}


# --- the plan ----------------------------------------------------------------

@dataclass
class _Lookup:
    """What every rank agreed on, and this rank's bags."""

    rank: int
    world: int
    tables_per_rank: list[int]      # T_s
    batch_sizes: list[int]          # B_d
    dim: int                        # D
    mode: str
    indices: list[torch.Tensor]     # per local table, as given
    bounds: list[torch.Tensor]      # per local table: offsets + [nnz], length B + 1
    estimate: tuple[float, float, int]  # (elements gathered, comm_bytes, rows) for ctx.decide

    @property
    def batch(self) -> int:
        return sum(self.batch_sizes)

    def positions(self, t: int, bags: Sequence[int]) -> dict[int, int]:
        """Index position where each bag in ``bags`` starts (one small host copy)."""
        bags = sorted(set(bags))
        where = self.bounds[t][torch.tensor(bags, dtype=torch.long, device=self.bounds[t].device)]
        return dict(zip(bags, where.tolist()))


def _piece_bags(plan: _Lookup, chunks: int) -> tuple[list[list[int]], list[list[int]]]:
    """``parts[d][j]``: rows of destination d in piece j; ``first[d][j]``: its first global bag."""
    starts = offsets(plan.batch_sizes)
    parts = [row_parts(b, chunks) for b in plan.batch_sizes]
    first = [[starts[d] + a for a in offsets(parts[d])] for d in range(plan.world)]
    return parts, first


def _check_local(op, tables, indices, offsets_, batch_sizes, mode, chunks, world):
    if not isinstance(tables, (list, tuple)) or not tables:
        raise ValueError(f"{op}: tables must be a non-empty list of [N_t, D] weights, got "
                         f"{tables!r:.60}")
    if not isinstance(indices, (list, tuple)) or not isinstance(offsets_, (list, tuple)) \
            or len(indices) != len(tables) or len(offsets_) != len(tables):
        raise ValueError(f"{op}: need one indices and one offsets tensor per table: {len(tables)} "
                         f"tables, {_count(indices)} indices, {_count(offsets_)} offsets")
    if not all(isinstance(t, torch.Tensor) for t in tables):
        raise TypeError(f"{op}: tables must be tensors, got {[type(t).__name__ for t in tables]}")
    dtype = check_float(op, *tables)
    if any(t.dim() != 2 for t in tables) or len({t.shape[1] for t in tables}) != 1:
        raise ValueError(f"{op}: tables must be [N_t, D] with one D; got shapes "
                         f"{[tuple(t.shape) for t in tables]}")
    if mode not in _MODES:
        raise ValueError(f"{op}: mode must be 'sum' or 'mean', got {mode!r}")
    batch = _check_bags(op, tables, indices, offsets_)
    sizes = even_sizes(batch, world) if batch_sizes is None else [int(b) for b in batch_sizes]
    if len(sizes) != world or any(b < 0 for b in sizes) or sum(sizes) != batch:
        raise ValueError(f"{op}: batch_sizes {sizes} must give each of {world} ranks a "
                         f"non-negative slice and sum to the batch of {batch} bags")
    check_chunks(op, chunks)
    return dtype, batch, sizes


def _count(seq) -> str:
    return str(len(seq)) if isinstance(seq, (list, tuple)) else type(seq).__name__


def _check_bags(op, tables, indices, offsets_) -> int:
    """Index dtypes, one batch size B for every table, and (values) bags inside their table."""
    device = tables[0].device
    for t, (table, idx, off) in enumerate(zip(tables, indices, offsets_)):
        if not isinstance(idx, torch.Tensor) or not isinstance(off, torch.Tensor):
            raise TypeError(f"{op}: indices[{t}] and offsets[{t}] must be tensors")
        if idx.dtype not in _INDEX_DTYPES or off.dtype != idx.dtype:
            raise TypeError(f"{op}: table {t}: indices ({idx.dtype}) and offsets ({off.dtype}) "
                            "must both be int64 or both int32")
        if idx.dim() != 1 or off.dim() != 1:
            raise ValueError(f"{op}: table {t}: indices {tuple(idx.shape)} and offsets "
                             f"{tuple(off.shape)} must be 1-D")
        if idx.device != device or off.device != device:
            raise ValueError(f"{op}: table {t}: indices/offsets on {idx.device}/{off.device}, "
                             f"tables on {device}")
    batches = [len(off) for off in offsets_]
    if len(set(batches)) != 1:
        raise ValueError(f"{op}: every table needs the same batch of bags; "
                         f"offsets lengths {batches}")
    for t, (table, idx, off) in enumerate(zip(tables, indices, offsets_)):
        if len(off) and (int(off[0]) != 0 or bool((off[1:] < off[:-1]).any())
                         or int(off[-1]) > len(idx)):
            raise ValueError(f"{op}: table {t}: offsets must start at 0, not decrease and stay "
                             f"within the {len(idx)} indices")
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= table.shape[0]):
            raise ValueError(f"{op}: table {t}: indices span [{int(idx.min())}, {int(idx.max())}] "
                             f"but the table has {table.shape[0]} rows")
    return batches[0]


@dataclass(frozen=True)
class EmbeddingCheck(Check):
    """``embedding_all_to_all``'s check: dtype, the embedding dim D, the batch of bags, the
    pooling mode, chunks, whether a backward follows and every rank's share of the batch
    must agree; this rank's table count T_r and its lookups may differ."""

    dtype: int
    D: int
    batch: int
    mode: int
    chunks: int
    needs_grad: int
    batch_sizes: tuple
    T_r: int
    lookups: int
    PER_RANK: ClassVar = frozenset({"batch_sizes"})


def _plan(op, tables, indices, offsets_, group, batch_sizes, mode, chunks, ctx):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    checked, problem = attempt(lambda: _check_local(op, tables, indices, offsets_, batch_sizes,
                                                    mode, chunks, world))
    row = []
    if problem is None:
        dtype, batch, sizes = checked
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tables)
        row = EmbeddingCheck(dtype_code(dtype), tables[0].shape[1], batch, _MODES[mode],
                             chunks_code(chunks), int(needs_grad), tuple(int(s) for s in sizes),
                             len(tables), sum(len(i) for i in indices)).row()
    metas = ctx.gather_meta(op, EmbeddingCheck.width(world), row, problem)  # shm: one header
    checks = EmbeddingCheck.from_rows(metas)
    modes = {code: name for name, code in _MODES.items()}
    check_same(op, ("dtype", "D", "batch", "mode", "chunks", "needs grad", "batch_sizes"),
               [(c.dtype, c.D, c.batch, modes[c.mode], c.chunks, c.needs_grad, c.batch_sizes)
                for c in checks])  # not T_r, lookups: a rank's own
    tables_per_rank, dim = [c.T_r for c in checks], checks[0].D
    max_nnz = max(c.lookups for c in checks)
    busiest = max(t * (batch - b) for t, b in zip(tables_per_rank, sizes))  # rows off this rank
    wire = busiest * dim * tables[0].element_size()
    bounds = [torch.cat([off, off.new_tensor([len(idx)])]) for idx, off in zip(indices, offsets_)]
    return _Lookup(rank, world, tables_per_rank, sizes, dim, mode, list(indices), bounds,
                   (float(dim * max_nnz), wire, max(sizes)))


# --- forward -------------------------------------------------------------------

def _pool(plan: _Lookup, t: int, weight: torch.Tensor, g0: int, g1: int, pos) -> torch.Tensor:
    """Pooled rows of bags [g0, g1) of local table t: [g1 - g0, D]."""
    lo, hi = pos[g0], pos[g1]
    return F.embedding_bag(plan.indices[t][lo:hi], weight, plan.bounds[t][g0:g1] - lo,
                           mode=plan.mode)


def _lookup_plain(weights, plan: _Lookup, group) -> torch.Tensor:
    """Pool every bag, then one all_to_all straight into the output ([T, B_r, D])."""
    w0, starts = weights[0], offsets(plan.batch_sizes)
    t_r, rank = len(weights), plan.rank
    send = w0.new_empty(t_r * plan.batch, plan.dim)  # (destination, table, row)
    for t, weight in enumerate(weights):
        pooled = _pool(plan, t, weight, 0, plan.batch, plan.positions(t, [0, plan.batch]))
        for d, b in enumerate(plan.batch_sizes):
            at = t_r * starts[d] + t * b
            send[at:at + b].copy_(pooled[starts[d]:starts[d + 1]])
    if plan.world == 1:
        return send.view(t_r, plan.batch, plan.dim)
    b_r, total = plan.batch_sizes[rank], sum(plan.tables_per_rank)
    out = w0.new_empty(total, b_r, plan.dim)
    transport_of(group).all_to_all(out.view(total * b_r, plan.dim), send,
                                   [t * b_r for t in plan.tables_per_rank],
                                   [t_r * b for b in plan.batch_sizes])
    return out


def _lookup_fused(weights, plan: _Lookup, group, chunks: int) -> torch.Tensor:
    rank, world, dim = plan.rank, plan.world, plan.dim
    t_r, t_s = len(weights), plan.tables_per_rank
    tstart, bstart = offsets(t_s), offsets(plan.batch_sizes)
    parts, first = _piece_bags(plan, chunks)
    pos = [plan.positions(t, [g for row in first for g in row]) for t in range(t_r)]
    out = weights[0].new_empty(tstart[-1], plan.batch_sizes[rank], dim)  # [T, B_r, D]
    pending = []
    for j in range(chunks):
        send = out.new_empty(sum(t_r * parts[d][j] for d in range(world) if d != rank), dim)
        at = 0
        for d in range(world):
            n = parts[d][j]
            if d == rank or n == 0:
                continue
            for t, weight in enumerate(weights):
                send[at:at + n].copy_(_pool(plan, t, weight, first[d][j], first[d][j] + n, pos[t]))
                at += n
        m = parts[rank][j]
        recv = out.new_empty(sum(t_s[s] * m for s in range(world) if s != rank), dim)
        work = start_all_to_all(recv, send,
                                [0 if s == rank else t_s[s] * m for s in range(world)],
                                [0 if d == rank else t_r * parts[d][j] for d in range(world)],
                                group)
        pending.append((work, recv, first[rank][j] - bstart[rank], m, send))
    lo, hi = bstart[rank], bstart[rank + 1]
    for t, weight in enumerate(weights):  # own rows: no wire; overlaps the last transfers
        if hi > lo:
            out[tstart[rank] + t].copy_(_pool(plan, t, weight, lo, hi, plan.positions(t, [lo, hi])))
    for work, recv, a, m, _ in pending:
        work.wait()
        at = 0
        for s in range(world):
            if s != rank and m:
                block = recv[at:at + t_s[s] * m].view(t_s[s], m, dim)
                out[tstart[s]:tstart[s + 1], a:a + m].copy_(block)
                at += t_s[s] * m
    return out


# --- backward ------------------------------------------------------------------

class _Grads:
    """Dense weight gradients of the local tables, filled by ``index_add_`` in call order."""

    def __init__(self, weights, plan: _Lookup, chunks: int):
        self.plan = plan
        self.grads = [torch.zeros_like(w) for w in weights]
        self.rows = [i.long() for i in plan.indices]
        sizes = [(b[1:] - b[:-1]).long() for b in plan.bounds]
        self.sizes = sizes
        self.bag_of = [torch.repeat_interleave(torch.arange(len(s), device=s.device), s,
                                               output_size=len(i))
                       for s, i in zip(sizes, plan.indices)]
        parts, first = _piece_bags(plan, chunks)
        bags = [g for row in first for g in row] + offsets(plan.batch_sizes)
        self.pos = [plan.positions(t, bags) for t in range(len(weights))]

    def add(self, t: int, g0: int, g: torch.Tensor) -> None:
        """Bags [g0, g0 + len(g)) of table t had gradient ``g`` ([n, D])."""
        lo, hi = self.pos[t][g0], self.pos[t][g0 + g.shape[0]]
        if hi == lo:
            return
        bag = self.bag_of[t][lo:hi]
        rows = g.index_select(0, bag - g0)  # [nnz, D]: each looked-up row's share
        if self.plan.mode == "mean":
            rows = rows / self.sizes[t].index_select(0, bag).unsqueeze(1).to(rows.dtype)
        self.grads[t].index_add_(0, self.rows[t][lo:hi], rows)


def _wgrad_plain(grad_out, grads: _Grads, group) -> None:
    plan = grads.plan
    t_r, starts = len(grads.grads), offsets(plan.batch_sizes)
    b_r = plan.batch_sizes[plan.rank]
    # [T·B_r, D]: each owner's tables contiguous
    send = grad_out.contiguous().view(sum(plan.tables_per_rank) * b_r, plan.dim)
    if plan.world == 1:
        recv = send
    else:
        recv = send.new_empty(t_r * plan.batch, plan.dim)  # (source, table, row)
        transport_of(group).all_to_all(recv, send, [t_r * b for b in plan.batch_sizes],
                                       [t * b_r for t in plan.tables_per_rank])
    for d, b in enumerate(plan.batch_sizes):  # sources in rank order
        block = recv[t_r * starts[d]:t_r * starts[d + 1]].view(t_r, b, plan.dim)
        for t in range(t_r):
            grads.add(t, starts[d], block[t])


def _wgrad_fused(grad_out, grads: _Grads, group, chunks: int) -> None:
    plan = grads.plan
    rank, world, dim = plan.rank, plan.world, plan.dim
    t_r, t_s = len(grads.grads), plan.tables_per_rank
    tstart, bstart = offsets(t_s), offsets(plan.batch_sizes)
    parts, first = _piece_bags(plan, chunks)
    pending = []
    for j in range(chunks):  # no compute before the wire: every piece starts at once
        m, a = parts[rank][j], first[rank][j] - bstart[rank]
        send = grad_out.new_empty(sum(t_s[s] * m for s in range(world) if s != rank), dim)
        at = 0
        for s in range(world):
            if s != rank and m:
                send[at:at + t_s[s] * m].view(t_s[s], m, dim).copy_(
                    grad_out[tstart[s]:tstart[s + 1], a:a + m])
                at += t_s[s] * m
        recv = grad_out.new_empty(sum(t_r * parts[d][j] for d in range(world) if d != rank), dim)
        work = start_all_to_all(recv, send,
                                [0 if d == rank else t_r * parts[d][j] for d in range(world)],
                                [0 if s == rank else t_s[s] * m for s in range(world)], group)
        pending.append((work, recv, j, send))  # send: alive until done
    for t in range(t_r):  # own rows first: they need no wire
        grads.add(t, bstart[rank], grad_out[tstart[rank] + t])
    for work, recv, j, _ in pending:
        work.wait()
        at = 0
        for d in range(world):
            n = parts[d][j]
            if d == rank or n == 0:
                continue
            block = recv[at:at + t_r * n].view(t_r, n, dim)
            for t in range(t_r):
                grads.add(t, first[d][j], block[t])
            at += t_r * n


class _EmbeddingAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan, decision, chunks, group, ops_ctx, *weights):
        if decision.path == "fallback":
            out = _lookup_plain(weights, plan, group)
        else:
            out = _lookup_fused(weights, plan, group, decision.chunks)
        ctx.plan, ctx.chunks, ctx.group, ctx.ops_ctx = plan, chunks, group, ops_ctx
        ctx.save_for_backward(*weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        plan, weights = ctx.plan, ctx.saved_tensors
        flops, wire, rows = plan.estimate
        decision = ctx.ops_ctx.decide("embedding_all_to_all.wgrad", ctx.chunks, rows=rows,
                                      work=Work(flops=0.0, wire_bytes=wire, receive=True,
                                                memory_bytes=flops * weights[0].element_size()))
        grads = _Grads(weights, plan, decision.chunks)
        if decision.path == "fallback":
            _wgrad_plain(grad_out, grads, ctx.group)
        else:
            _wgrad_fused(grad_out, grads, ctx.group, decision.chunks)
        return (None, None, None, None, None, *grads.grads)


def embedding_all_to_all(tables: Sequence[torch.Tensor], indices: Sequence[torch.Tensor],
                         offsets: Sequence[torch.Tensor], group=None, *,
                         batch_sizes: Sequence[int] | None = None, mode: str = "sum",
                         chunks="auto", ctx: OpsContext | None = None) -> torch.Tensor:
    """Pool this rank's tables over the whole batch and all_to_all the result: ``[B_r, T, D]``.

    ``tables``: this rank's weights ``[N_t, D]``; ``indices[t]``, ``offsets[t]``: table
    t's bags for the whole global batch (EmbeddingBag's 1-D convention). Output
    column t is global table t (tables by owner rank, then local order).
    ``batch_sizes``: every rank's slice of the batch (default: even). ``mode``:
    "sum" or "mean". ``chunks``: "auto" (the cost model picks, or falls back and
    records why: ``plait.ops.explain``) or a piece count; 1 is the plain path.
    Every rank must call it, with tables that all require grad or none. Under
    ``torch.compile``: one registered op (``plait::opaque``) running this eagerly, the
    batch shares fixed in the graph, the group's own context.
    """
    if torch.compiler.is_compiling():
        n = len(tables)
        shares = None if batch_sizes is None else tuple(int(b) for b in batch_sizes)
        return opaque([*tables, *indices, *offsets],
                      opaque_key("embedding_all_to_all", _direct, _direct_like, n, shares,
                                 group_key(group), mode, chunks))
    ctx = ctx or get_context(group)
    op = "embedding_all_to_all"
    plan = _plan(op, tables, indices, offsets, group, batch_sizes, mode, chunks, ctx)
    flops, wire, rows = plan.estimate
    decision = ctx.decide(op, chunks, rows=rows, work=Work(  # gathers: memory-bound
        flops=0.0, wire_bytes=wire, memory_bytes=flops * tables[0].element_size()))
    out = _EmbeddingAllToAll.apply(plan, decision, chunks, group, ctx, *tables)
    return out.transpose(0, 1)


# --- called directly under torch.compile: one opaque op (plait.ops.library) --------------
def _direct(*args) -> torch.Tensor:
    *t, n, shares, group, mode, chunks = args
    return embedding_all_to_all(t[:n], t[n:2 * n], t[2 * n:], group_of(group),
                                batch_sizes=shares, mode=mode, chunks=chunks)


def _direct_like(*args) -> torch.Tensor:
    """[B_r, T, D]: this rank's share of the batch (the bags' count), every rank's tables
    (a count only the run knows: a size the graph leaves open)."""
    *t, n, shares, group, mode, chunks = args
    g = group_of(group)
    world, rank = dist.get_world_size(g), dist.get_rank(g)
    rows = shares[rank] if shares else even_sizes(t[2 * n].shape[0], world)[rank]
    return t[0].new_empty(rows, torch.library.get_ctx().new_dynamic_size(), t[0].shape[1])

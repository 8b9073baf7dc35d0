"""AllGather + GEMM and GEMM + ReduceScatter: each is the other's backward.

``all_gather_matmul``: ``y = all_gather(x) @ w`` (sequence-parallel column-parallel linear)

=======  ===================  =========================================
tensor   shape on rank r      note
=======  ===================  =========================================
x        [M_r, K]             rows sharded; M_r may differ (``sizes``)
w        [K, N_r]             column shard of the weight
y        [M, N_r]             M = Σ M_r, rows in rank order
=======  ===================  =========================================

backward: dgrad ``dx = reduce_scatter(dy @ wᵀ)`` = ``matmul_reduce_scatter(dy, wᵀ)`` (fused);
wgrad ``dw = all_gather(x)ᵀ @ dy`` (the gathered x is kept from the forward).

``matmul_reduce_scatter``: ``y = reduce_scatter(x @ w)`` (sequence-parallel row-parallel linear)

=======  ===================  =========================================
x        [M, K_r]             reduction dim sharded
w        [K_r, N]
y        [M_r, N]             this rank's rows of the sum over ranks
=======  ===================  =========================================

backward: dgrad ``dx = all_gather(dy) @ wᵀ`` = ``all_gather_matmul(dy, wᵀ)`` (fused);
wgrad ``dw = xᵀ @ all_gather(dy)`` (the gathered dy comes out of that same call).

Schedule. Every rank's rows are cut into the same number of pieces. Gather:
all pieces' transfers start at once; this rank's own rows are multiplied
first (they need no wire), then each piece as it lands, straight into its
rows of y. Reduce-scatter: piece j's partial products for every other rank
are computed into one send buffer and its all_to_all starts; this rank's own
partial products (no wire needed) are computed last, straight into y, while
the last pieces travel, and the arrivals are then added. The sum runs in rank
order, so results are deterministic and the plain path (one piece) gives the
same numbers up to GEMM blocking. The transfer is an all_to_all rather than
gloo's reduce_scatter: it moves (n−1)/n of the data, where gloo's moves as much
as an all_reduce, and it accepts uneven rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
import torch.distributed as dist

from .agree import Check, check_chunks, chunks_code, dtype_code
from .context import Decision, OpsContext, attempt, get_context
from ..perf.pieces import Work
from .exchange import start_all_to_all, start_gather
from .pieces import (as_rows, check_float, check_sizes, even_sizes, offsets,
                     tapered)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "GatherCheck", "ScatterCheck"]


def _row_pieces(sizes: Sequence[int], chunks: int) -> list[list[int]]:
    """``pieces[j][r]``: rows of rank r in piece j (each rank's rows cut into ``chunks``)."""
    per_rank = [tapered(s, chunks) + [0] * (chunks - len(tapered(s, chunks))) for s in sizes]
    return [[per_rank[r][j] for r in range(len(sizes))] for j in range(chunks)]


# --- all_gather_matmul ------------------------------------------------------

def _gather_forward(x, w, group, rows, decision):
    """Returns (y [M, N_r], the gathered x [M, K] as the pieces it arrived in)."""
    rank = dist.get_rank(group)
    starts = offsets(rows)
    pieces = _row_pieces(rows, decision.chunks)
    y = x.new_empty(starts[-1], w.shape[1])
    bufs, works, local_at = [], [], 0
    for piece_rows in pieces:  # start every transfer; none waits for compute
        buf = x.new_empty(sum(piece_rows), x.shape[1])
        mine = x[local_at:local_at + piece_rows[rank]]
        works.append(start_gather(buf, mine, piece_rows, group))
        bufs.append(buf)
        local_at += piece_rows[rank]
    torch.matmul(x, w, out=y[starts[rank]:starts[rank + 1]])  # own rows: no wire needed
    done = [0] * len(rows)
    for buf, piece_rows, work in zip(bufs, pieces, works):
        work.wait()
        at = 0
        for src, n in enumerate(piece_rows):
            if src != rank and n:
                row = starts[src] + done[src]
                torch.matmul(buf[at:at + n], w, out=y[row:row + n])
            at += n
            done[src] += n
    return y, _Gathered(bufs, pieces, starts)


class _Gathered:
    """The gathered rows as the pieces they arrived in: no rank-order copy is ever made.

    ``gathered = cat over ranks s of cat over pieces j of bufs[j][rows of s]``.
    """

    def __init__(self, bufs, pieces, starts):
        self.bufs, self.pieces, self.starts = bufs, pieces, starts

    def segments(self):
        """(rows of the gathered tensor, that segment), in a fixed order."""
        done = [0] * len(self.starts[:-1])
        for buf, piece_rows in zip(self.bufs, self.pieces):
            at = 0
            for src, n in enumerate(piece_rows):
                if n:
                    row = self.starts[src] + done[src]
                    yield slice(row, row + n), buf[at:at + n]
                at += n
                done[src] += n

    def t_matmul(self, other):
        """``gatheredᵀ @ other`` as a sum over segments (fixed order)."""
        out = None
        for rows, seg in self.segments():
            part = seg.t() @ other[rows]
            out = part if out is None else out.add_(part)
        return out

    def left_t_matmul(self, other):
        """``otherᵀ @ gathered`` as a sum over segments (fixed order)."""
        out = None
        for rows, seg in self.segments():
            part = other[rows].t() @ seg
            out = part if out is None else out.add_(part)
        return out


@dataclass(frozen=True)
class GatherCheck(Check):
    """``all_gather_matmul``'s check: this rank's rows M_r and columns N_r (both may
    differ), and what fixes the wire schedule: dtype, K, chunks, whether a backward (a
    reduce-scatter) follows, the rows per index of the gathered dim, every rank's sizes
    (-1 each where they are as found)."""

    M_r: int
    N_r: int
    dtype: int
    K: int
    chunks: int
    x_needs_grad: int
    unit: int
    sizes: tuple
    AGREED: ClassVar = ("dtype", "K", "chunks", "x_needs_grad", "unit", "sizes")
    PER_RANK: ClassVar = frozenset({"sizes"})
    LABELS: ClassVar = {"x_needs_grad": "x needs grad", "unit": "rows per index of dim"}


@dataclass(frozen=True)
class ScatterCheck(Check):
    """``matmul_reduce_scatter``'s check: dtype, M, N, chunks, whether a backward (a
    gather) follows and every rank's sizes must agree; K_r may differ (uneven shards)."""

    dtype: int
    M: int
    N: int
    chunks: int
    needs_grad: int
    K_r: int
    sizes: tuple
    AGREED: ClassVar = ("dtype", "M", "N", "chunks", "needs_grad", "sizes")
    PER_RANK: ClassVar = frozenset({"sizes"})
    LABELS: ClassVar = {"needs_grad": "needs grad"}


def _chain(op: str, x: torch.Tensor, w: torch.Tensor, k_name: str) -> None:
    check_float(op, x, w)
    if x.dim() != 2 or w.dim() != 2 or w.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x {tuple(x.shape)} and w {tuple(w.shape)} do not chain; "
                         f"need x [M{k_name}] and w [K, N]")


def _gather_plan(op, group, chunks, ctx, prepare) -> tuple[torch.Tensor, list[int], Decision]:
    """(x [M_r, K], every rank's rows, the decision), once every rank agrees on all that
    fixes the wire schedule: dtype, K, chunks, sizes, the rows per index of the gathered
    dim, and whether a backward (a reduce-scatter) will follow.

    ``prepare()``: this rank's ``(x [M_r, K], w [K, N_r], row sizes or None, rows per
    index, x needs grad)``; whatever it raises is refused on every rank, as the checks
    here are.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    got = {}

    def local():
        x, w, sizes, unit, needs_grad = got["args"] = prepare()
        check_chunks(op, chunks)
        _chain(op, x, w, "_r, K")
        if sizes is not None:
            check_sizes(op, "sizes", sizes, world, x.shape[0], rank)
        return GatherCheck(x.shape[0], w.shape[1], dtype_code(x.dtype), x.shape[1],
                           chunks_code(chunks), int(needs_grad), unit,
                           tuple(int(v) for v in sizes) if sizes is not None else (-1,) * world
                           ).row()
    row, problem = attempt(local)
    metas = ctx.gather_meta(op, GatherCheck.width(world), row, problem)
    GatherCheck.agree(op, metas)
    checks = GatherCheck.from_rows(metas)
    x = got["args"][0]
    rows = [c.M_r for c in checks]
    # w's width N_r may differ per rank (an uneven column plan): the busiest prices auto
    m, k, n = sum(rows), x.shape[1], max(c.N_r for c in checks)
    own = min(rows)  # the busiest rank: fewest own rows, most to wait for
    work = Work(flops=2.0 * (m - own) * k * n, lead_flops=2.0 * own * k * n, receive=True,
                wire_bytes=(world - 1) / world * m * k * x.element_size(), kind="all_gather",
                length=max(1, m // world), width=n)
    return x, rows, ctx.decide(op, chunks, work=work, rows=own or 1)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group, rows, decision, chunks, ops_ctx):
        y, gathered = _gather_forward(x, w, group, rows, decision)
        ctx.save_for_backward(w)
        ctx.gathered = gathered  # buffers made here, not inputs: safe to keep as an attribute
        ctx.group, ctx.rows, ctx.chunks, ctx.ops_ctx = group, rows, chunks, ops_ctx
        return y

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        gathered = ctx.gathered
        dy = dy.contiguous()
        dx, grads = None, {}

        def wgrad():  # under the dgrad's last piece
            if ctx.needs_input_grad[1]:
                grads["dw"] = gathered.t_matmul(dy)
        if ctx.needs_input_grad[0]:
            wt = w.t()
            decision = _scatter_plan("all_gather_matmul.dgrad", ctx.group, ctx.chunks,
                                     ctx.ops_ctx, lambda: (dy, wt, ctx.rows, False))
            dx = _scatter_forward(dy, wt, ctx.group, ctx.rows, decision, meanwhile=wgrad)
        else:
            wgrad()
        return dx, grads.get("dw"), None, None, None, None, None


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group=None, dim: int = 0, *,
                      sizes: Sequence[int] | None = None, chunks="auto",
                      ctx: OpsContext | None = None) -> torch.Tensor:
    """``all_gather(x, dim) @ w``, multiplying each gathered piece as it arrives.

    ``x`` may have any rank; it is gathered along ``dim`` and multiplied on its
    last dim. ``sizes``: every rank's length along ``dim`` (default: as found; under
    ``torch.compile``, equal, which the gather checks when it runs). Under
    ``torch.compile``: the gather (a registered op, its backward a reduce-scatter), then
    the GEMM.
    """
    if torch.compiler.is_compiling():
        from .regions import gather_for_matmul

        return gather_for_matmul(x, group, dim, sizes) @ w
    ctx = ctx or get_context(group)
    op = "all_gather_matmul"
    view = {}

    def prepare():
        view["x2"], view["restore"] = _rows_view(op, x, dim)
        view["unit"] = unit = _rows_per_unit(x, dim)
        if sizes is not None:
            check_sizes(op, "sizes", sizes, dist.get_world_size(group), x.shape[dim],
                        dist.get_rank(group))
        row_sizes = None if sizes is None else [int(s) * unit for s in sizes]
        return view["x2"], w, row_sizes, unit, torch.is_grad_enabled() and x.requires_grad
    x2, rows, decision = _gather_plan(op, group, chunks, ctx, prepare)
    y = _AllGatherMatmul.apply(x2, w, group, rows, decision, chunks, ctx)
    return view["restore"](y, sum(rows) // max(1, view["unit"]))


# --- matmul_reduce_scatter --------------------------------------------------

def _scatter_forward(x, w, group, rows, decision, meanwhile=None):
    """[M, K_r] @ [K_r, N] → this rank's rows [M_r, N] of the sum over ranks; ``meanwhile``
    runs while the last pieces are on the wire (a backward's weight gradient).

    Remote rows first: each piece holds only the partial sums other ranks need, and
    goes onto the wire as soon as it is computed. This rank's own partial sums need no
    wire, so they are computed last, straight into y, while the last pieces travel;
    then the arrivals are added in rank order.
    """
    world, rank = len(rows), dist.get_rank(group)
    starts = offsets(rows)
    pieces = _row_pieces(rows, decision.chunks)
    y = x.new_empty(rows[rank], w.shape[1])
    own = slice(starts[rank], starts[rank + 1])
    plain = len(pieces) == 1  # the fallback: everything computed, then sent
    if plain:
        torch.matmul(x[own], w, out=y)
    done = [0] * world
    in_flight = []
    for piece_rows in pieces:
        sent = [0 if dst == rank else n for dst, n in enumerate(piece_rows)]
        send = x.new_empty(sum(sent), w.shape[1])
        at = 0
        for dst, n in enumerate(sent):
            if n:
                row = starts[dst] + done[dst]
                torch.matmul(x[row:row + n], w, out=send[at:at + n])
            at += n
        mine = piece_rows[rank]
        got = [0 if src == rank else mine for src in range(world)]
        recv = x.new_empty(sum(got), w.shape[1])
        in_flight.append((start_all_to_all(recv, send, got, sent, group), recv, mine,
                          done[rank]))
        done = [d + n for d, n in zip(done, piece_rows)]
    if not plain:
        torch.matmul(x[own], w, out=y)  # own rows: beside the last pieces on the wire
    if meanwhile is not None:
        meanwhile()
    for work, recv, n, row in in_flight:
        _reduce_into(y, work, recv, n, row, rank, world)
    return y


def _reduce_into(y, work, recv, n, row, rank, world):
    """y[row:row+n] holds this rank's own partial sums; add the other ranks' (``recv``,
    in rank order without this one) so the sum runs in rank order: deterministic, and
    the plain path's order."""
    work.wait()
    if n == 0 or world == 1:  # a world of one: its own sums are the whole sum
        return
    out = y[row:row + n]
    others = recv.view(world - 1, n, -1)
    if world == 2:  # a + b == b + a exactly: add in place
        out.add_(others[0])
        return
    parts = [out if src == rank else others[src - (src > rank)] for src in range(world)]
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    out.copy_(total)


def _scatter_plan(op, group, chunks, ctx, prepare) -> Decision:
    """The decision, once every rank agrees on all that fixes the wire schedule: dtype,
    M, N, chunks, sizes, and whether a backward (a gather) will follow.

    ``prepare()``: this rank's ``(x [M, K_r], w [K_r, N], row sizes, needs grad)``;
    whatever it raises is refused on every rank, as the checks here are.
    """
    world = dist.get_world_size(group)
    got = {}

    def local():
        x, w, sizes, needs_grad = got["args"] = prepare()
        check_chunks(op, chunks)
        _chain(op, x, w, ", K_r")
        if len(sizes) != world or any(s < 0 for s in sizes):
            raise ValueError(f"{op}: sizes {list(sizes)} must give each of {world} ranks "
                             "a non-negative share")
        if sum(sizes) != x.shape[0]:
            raise ValueError(f"{op}: sizes {list(sizes)} sum to {sum(sizes)}, "
                             f"but x has {x.shape[0]} rows")
        return ScatterCheck(dtype_code(x.dtype), x.shape[0], w.shape[1], chunks_code(chunks),
                            int(needs_grad), x.shape[1], tuple(int(v) for v in sizes)).row()
    row, problem = attempt(local)
    metas = ctx.gather_meta(op, ScatterCheck.width(world), row, problem)
    ScatterCheck.agree(op, metas)
    checks = ScatterCheck.from_rows(metas)
    x, _, sizes, _ = got["args"]
    m, n = checks[0].M, checks[0].N
    k_max = max(c.K_r for c in checks)
    own = min(sizes)  # the busiest rank: fewest own rows, most to compute before the wire
    work = Work(flops=2.0 * (m - own) * k_max * n, tail_flops=2.0 * own * k_max * n,
                wire_bytes=(world - 1) / world * m * n * x.element_size(),
                length=max(1, m // world), width=n)  # each piece: one GEMM per destination
    return ctx.decide(op, chunks, work=work, rows=max(min(sizes), 1))


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, group, rows, decision, chunks, ops_ctx):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.rows, ctx.chunks, ctx.ops_ctx = group, rows, chunks, ops_ctx
        return _scatter_forward(x, w, group, rows, decision)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        wt = w.t()
        dy = dy.contiguous()
        _, rows, decision = _gather_plan("matmul_reduce_scatter.dgrad", ctx.group, ctx.chunks,
                                         ctx.ops_ctx, lambda: (dy, wt, ctx.rows, 1, False))
        dx, gathered_dy = _gather_forward(dy, wt, ctx.group, rows, decision)
        dw = gathered_dy.left_t_matmul(x) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group=None, dim: int = 0, *,
                          sizes: Sequence[int] | None = None, chunks="auto",
                          ctx: OpsContext | None = None) -> torch.Tensor:
    """``reduce_scatter(x @ w, dim)``, each piece's partial sums on the wire as soon as computed.

    ``sizes``: every rank's share of ``dim`` of the output (default: even). Under
    ``torch.compile``: the GEMM, then the reduce-scatter (a registered op).
    """
    if torch.compiler.is_compiling():
        from .regions import reduce_scatter_region

        return reduce_scatter_region(x @ w, group, dim, sizes)
    ctx = ctx or get_context(group)
    op, world = "matmul_reduce_scatter", dist.get_world_size(group)
    view = {}

    def prepare():
        view["x2"], view["restore"] = _rows_view(op, x, dim)
        length = x.shape[dim]
        view["sizes"] = even_sizes(length, world) if sizes is None else [int(s) for s in sizes]
        if sum(view["sizes"]) != length:
            raise ValueError(f"{op}: sizes {view['sizes']} sum to {sum(view['sizes'])}, "
                             f"but x has {length} rows along dim {dim}")
        view["rows"] = [s * _rows_per_unit(x, dim) for s in view["sizes"]]
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)
        return view["x2"], w, view["rows"], needs_grad
    decision = _scatter_plan(op, group, chunks, ctx, prepare)
    x2, rows = view["x2"], view["rows"]
    y = _MatmulReduceScatter.apply(x2, w, group, rows, decision, chunks, ctx)
    return view["restore"](y, view["sizes"][dist.get_rank(group)])


def _rows_per_unit(x: torch.Tensor, dim: int) -> int:
    """Rows of the [rows, K] view per index of ``dim`` (the product of the other non-feature
    dims), from the shape alone, so a rank whose share of ``dim`` is empty still knows it."""
    others = [size for d, size in enumerate(x.shape[:-1]) if d != dim % x.dim()]
    return int(torch.Size(others).numel())


def _rows_view(op: str, x: torch.Tensor, dim: int):
    """x as [rows, K] with ``dim`` leading (a view when dim == 0), and how to undo it for y."""
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not -x.dim() <= dim < x.dim() - 1:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: dim {dim} of x {shape} is not a row dim (the last dim "
                         "is the feature dim)")
    dim = dim % x.dim()
    moved = x.movedim(dim, 0)
    middle = moved.shape[1:-1]
    x2 = as_rows(moved)

    def restore(y: torch.Tensor, length: int) -> torch.Tensor:
        out = y.view(length, *middle, y.shape[-1])
        return out.movedim(0, dim) if dim else out
    return x2, restore

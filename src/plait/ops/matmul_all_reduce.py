"""GEMM/GEMV + AllReduce, and its dual (column-parallel matmul whose backward is one).

``matmul_all_reduce``:  ``y = all_reduce(x @ w)``, ``x`` sharded on K.

=========  ====================  ==========================================
tensor     shape on rank r       note
=========  ====================  ==========================================
x          [..., K_r]            K_r may differ per rank (uneven shards)
w          [K_r, N]
y          [..., N]              identical on every rank
=========  ====================  ==========================================

Backward (the output is replicated, so no collective is needed):
``dgrad dx = dy @ wᵀ``, ``wgrad dw = xᵀ @ dy``.

Schedule: the M = prod(...) rows are cut into pieces (the first and last half
size: they are the pipeline's exposed ends); each piece is computed straight
into its rows of the output with ``matmul(out=)`` and its all_reduce starts at
once, while the next piece is computed. For GEMV (M ≤ 8, decoding) rows cannot
be cut, so pieces are column blocks of N, each computed into a contiguous slot:
rows of one transposed output when every rank's w is column-major (as
row-parallel layers pass it; nothing is copied), else a flat buffer laid side
by side at the end (a copy of the few output rows).

``column_parallel_matmul``: ``y_r = x @ w_r`` (x replicated, w [K, N_r]); its
backward's dgrad ``dx = Σ_r dy_r @ w_rᵀ`` is exactly a ``matmul_all_reduce``
and runs fused; wgrad ``dw_r = xᵀ @ dy_r`` is local and runs once the last dgrad
piece is on the wire, under its all_reduce, followed there by any weight
gradient a ``matmul_all_reduce(wgrad_into=)`` deferred (:mod:`plait.ops.deferred`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .agree import attempt, check_chunks
from .compute import compute_region, current_region, piece
from .context import Decision, OpsContext, get_context
from ..perf.pieces import Work
from .deferred import accumulate, defer, run_deferred
from .pieces import DTYPE_CODES, check_float, offsets, tapered

__all__ = ["matmul_all_reduce", "column_parallel_matmul", "GEMV_ROWS"]

GEMV_ROWS = 8  # at most this many rows: split N instead of M


def _local_row(op: str, x2: torch.Tensor, w: torch.Tensor) -> tuple[int, int, int, int]:
    check_float(op, x2, w)
    if w.dim() != 2 or w.shape[0] != x2.shape[1]:
        raise ValueError(f"{op}: x has K={x2.shape[1]} columns but w is {tuple(w.shape)}; "
                         "w must be [K, N]")
    return DTYPE_CODES[x2.dtype], x2.shape[0], w.shape[1], x2.shape[1], int(_column_major(w))


def _column_major(w: torch.Tensor) -> bool:
    """w laid out as ``weight.t()`` of a contiguous [N, K] (what row-parallel layers pass)."""
    return w.stride(0) == 1 and (w.shape[1] == 1 or w.stride(1) >= w.shape[0])


def _plan(op: str, x2: torch.Tensor, w: torch.Tensor, chunks,
          ctx: OpsContext) -> tuple[Decision, bool]:
    """The decision, and whether a GEMV holds its output transposed: only when every
    rank's w is column-major, since all ranks must reduce buffers of the same layout."""
    row, problem = attempt(lambda: (check_chunks(op, chunks), _local_row(op, x2, w))[1])
    metas = ctx.gather_meta(op, 5, row, problem)
    for r, meta in enumerate(metas):
        if meta[:3] != metas[0][:3]:
            raise ValueError(f"{op}: ranks disagree on (dtype, M, N): rank 0 has {metas[0][:3]}, "
                             f"rank {r} has {meta[:3]}")
    world, m, n = len(metas), metas[0][1], metas[0][2]
    k_max = max(meta[3] for meta in metas)
    wire = 2 * (world - 1) / world * m * n * x2.element_size()
    gemv = m <= GEMV_ROWS  # pieces cut N: [M, N_j] each
    work = Work(flops=2.0 * m * k_max * n, wire_bytes=wire, kind="all_reduce",
                length=n if gemv else m, width=m if gemv else n, columns=gemv)
    return ctx.decide(op, chunks, work=work, rows=work.length), all(meta[4] for meta in metas)


def _fused_forward(x2: torch.Tensor, w: torch.Tensor, group, decision: Decision,
                   transposed: bool, meanwhile=None) -> torch.Tensor:
    """[M, K_r] @ [K_r, N] → all-reduced [M, N]; pieces overlap their all_reduce.

    ``meanwhile``: called once every piece is on the wire, before waiting for them (a
    backward computes its weight gradient there, under the last pieces' all_reduce).
    """
    m, n = x2.shape[0], w.shape[1]
    if decision.path == "fallback":
        with piece():
            out = x2 @ w
        return _waited(out, [dist.all_reduce(out, group=group, async_op=meanwhile is not None)],
                       meanwhile)
    if m <= GEMV_ROWS:
        return _gemv_pieces(x2, w, group, decision.chunks, transposed, meanwhile)
    bounds = offsets(tapered(m, decision.chunks))
    out = x2.new_empty(m, n)  # the collective's buffer is the output
    works = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        with piece():
            torch.matmul(x2[lo:hi], w, out=out[lo:hi])
        works.append(dist.all_reduce(out[lo:hi], group=group, async_op=True))
    return _waited(out, works, meanwhile)


def _waited(out: torch.Tensor, works, meanwhile) -> torch.Tensor:
    """Run ``meanwhile`` (if any) while ``works`` are in flight, wait for them, give ``out``."""
    if meanwhile is not None:
        meanwhile()
    for work in works:
        if work is not None:
            work.wait()
    return out


def _gemv_pieces(x2: torch.Tensor, w: torch.Tensor, group, chunks: int,
                 transposed: bool, meanwhile=None) -> torch.Tensor:
    """GEMV: pieces are column blocks [M, N_j], each reduced as soon as it is computed.

    A column block of a row-major [M, N] is not contiguous (gloo sends contiguous
    buffers). When w is column-major (a row-parallel layer passes ``weight.t()`` of its
    [N, K_r] weight) on every rank, the output is held transposed: block j is rows [lo, hi) of one
    [N, M] buffer, the result is that buffer's transpose (a view), and nothing is held
    beyond the output; BLAS also runs this orientation about 2x faster here than x2 @ w.
    A row-major w runs the transposed orientation 2x slower, so its blocks go into
    one flat buffer and are laid side by side at the end (one copy of the M ≤ 8 rows).
    """
    m, n = x2.shape[0], w.shape[1]
    bounds = offsets(tapered(n, chunks))
    buf = x2.new_empty(n, m) if transposed else x2.new_empty(m * n)
    blocks, works = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        block = buf[lo:hi] if transposed else buf[m * lo:m * hi].view(m, hi - lo)
        with piece():
            torch.mm(x2, w[:, lo:hi], out=block.t() if transposed else block)
        works.append(dist.all_reduce(block, group=group, async_op=True))
        blocks.append(block)
    _waited(buf, works, meanwhile)
    return buf.t() if transposed else torch.cat(blocks, dim=1)


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, group, decision, transposed, wgrad_into):
        ctx.save_for_backward(x2, w)
        ctx.region, ctx.wgrad_into = current_region(), wgrad_into
        return _fused_forward(x2, w, group, decision, transposed)

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        region, param, dw = ctx.region, ctx.wgrad_into, None
        with compute_region(region), piece():
            dx = dy @ w.t() if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1] and param is None:
                dw = x2.t() @ dy
        if ctx.needs_input_grad[1] and param is not None:
            def wgrad():  # in the parameter's [N, K_r] layout
                with compute_region(region), piece():
                    accumulate(param, dy.t() @ x2)
            defer(wgrad)
        return dx, dw, None, None, None, None


def matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group=None, *, chunks="auto",
                      ctx: OpsContext | None = None,
                      wgrad_into: torch.Tensor | None = None) -> torch.Tensor:
    """``all_reduce(x @ w)`` with the all_reduce of each piece overlapping the next piece's compute.

    ``chunks``: "auto" (the calibrated cost model picks, or falls back to the
    plain path and records why: see ``plait.ops.explain``) or a piece count.
    ``wgrad_into``: the parameter ``p`` that ``w`` is the transpose of (``w = p.t()``, as
    a row-parallel layer passes it): the weight gradient is then deferred to run under
    the backward's next fused collective and added to ``p.grad``
    (:mod:`plait.ops.deferred`), instead of being returned through autograd.
    """
    ctx = ctx or get_context(group)
    x2 = x.reshape(-1, x.shape[-1])
    if wgrad_into is not None and tuple(wgrad_into.shape) != (w.shape[1], w.shape[0]):
        raise ValueError(f"matmul_all_reduce: wgrad_into {tuple(wgrad_into.shape)} is not the "
                         f"transposed shape of w {tuple(w.shape)}")
    decision, transposed = _plan("matmul_all_reduce", x2, w, chunks, ctx)
    out = _MatmulAllReduce.apply(x2, w, group, decision, transposed, wgrad_into)
    return out.reshape(*x.shape[:-1], w.shape[1]) if x.dim() != 2 else out


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, group, chunks, ops_ctx):
        ctx.save_for_backward(x2, w)
        ctx.group, ctx.chunks, ctx.ops_ctx = group, chunks, ops_ctx
        ctx.region = current_region()
        with piece():
            return x2 @ w

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        dx = dw = None
        with compute_region(ctx.region):
            grads = {}

            def wgrad():  # under the dgrad's last all_reduces, with what was deferred
                if ctx.needs_input_grad[1]:
                    with piece():
                        grads["dw"] = x2.t() @ dy
                run_deferred()
            if ctx.needs_input_grad[0]:
                wt = w.t()
                decision, transposed = _plan("column_parallel_matmul.dgrad", dy, wt, ctx.chunks,
                                             ctx.ops_ctx)
                dx = _fused_forward(dy.contiguous(), wt, ctx.group, decision, transposed,
                                    meanwhile=wgrad)
            else:
                wgrad()
        return dx, grads.get("dw"), None, None, None


def column_parallel_matmul(x: torch.Tensor, w: torch.Tensor, group=None, *, chunks="auto",
                           ctx: OpsContext | None = None) -> torch.Tensor:
    """``x @ w_r`` forward (x replicated); backward's dgrad is a fused ``matmul_all_reduce``."""
    ctx = ctx or get_context(group)
    x2 = x.reshape(-1, x.shape[-1])
    _local_row("column_parallel_matmul", x2, w)  # its forward is local: only local checks
    out = _ColumnParallelMatmul.apply(x2, w, group, chunks, ctx)
    return out.reshape(*x.shape[:-1], w.shape[1]) if x.dim() != 2 else out

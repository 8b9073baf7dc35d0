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

``matmul_all_reduce_start``: the same operator, returned while its last pieces
are still on the wire (an :class:`InFlight`; ``wait()`` gives ``y``), so the
caller can compute something independent meanwhile: ``plait.nn``'s interleaved
micro-batches run one micro-batch's layers under another's all-reduce.

Schedule: the M = prod(...) rows are cut into pieces (the first and last half
size: they are the pipeline's exposed ends); each piece is computed straight
into its rows of the output with ``matmul(out=)`` and its all_reduce starts at
once, while the next piece is computed. For GEMV (M ≤ 8, decoding) rows cannot
be cut, so pieces are column blocks of N, each computed into a contiguous slot:
rows of one transposed buffer when every rank's w is column-major (as
row-parallel layers pass it), returned as that buffer's ``[M, N]`` view (no copy:
laying it out contiguous cost 0.19 ms of a 6.3 ms call at 8 x 65536), else a flat
buffer laid side by side at the end (the few output rows).

``column_parallel_matmul``: ``y_r = x @ w_r`` (x replicated, w [K, N_r]); its
backward's dgrad ``dx = Σ_r dy_r @ w_rᵀ`` is exactly a ``matmul_all_reduce``
and runs fused; wgrad ``dw_r = xᵀ @ dy_r`` is local and runs once the last dgrad
piece is on the wire, under its all_reduce, followed there by any weight
gradient a ``matmul_all_reduce(wgrad_into=)`` deferred (:mod:`plait.ops.deferred`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .agree import Check, check_chunks, chunks_code, dtype_code
from .context import (Decision, OpsContext, attempt, carries_checks, get_context, signature,
                      transport_of)
from .pieces import as_rows, check_float, compute_region, current_region, offsets, piece, tapered
from ..perf.pieces import Work
from .deferred import accumulate, defer, run_deferred
from ..transport.calls import Carried
from .library import define, group_key, group_of

__all__ = ["matmul_all_reduce", "matmul_all_reduce_start", "InFlight", "column_parallel_matmul",
           "GEMV_ROWS", "traced_matmul_all_reduce", "traced_column_matmul", "MatmulCheck",
           "DgradCheck", "local_check", "dgrad_check", "same_dgrad"]

GEMV_ROWS = 8  # at most this many rows: split N instead of M
OP = "matmul_all_reduce"


@dataclass(frozen=True)
class MatmulCheck(Check):
    """``Σ_ranks x2 [M, K_r] @ w [K_r, N]``'s check: dtype, M, N and chunks fix the wire
    schedule and must agree; K_r may differ (uneven shards); w's layout must agree only
    where a GEMV holds its product transposed (``_carried``)."""

    dtype: int
    M: int
    N: int
    chunks: int
    K_r: int
    w_column_major: int
    AGREED: ClassVar = ("dtype", "M", "N", "chunks")
    LABELS: ClassVar = {"w_column_major": "w column-major"}


@dataclass(frozen=True)
class DgradCheck(MatmulCheck):
    """``column_parallel_matmul``'s backward, known in the forward: ``dy [M, N_r] @ wᵀ
    [N_r, K]`` as a :class:`MatmulCheck` (its N the layer's K, its K_r the layer's N_r), and
    whether this rank will run that all-reduce (its x needs a gradient)."""

    x_needs_grad: int
    AGREED: ClassVar = ("dtype", "M", "N", "chunks", "x_needs_grad")
    LABELS: ClassVar = {"N": "K", "x_needs_grad": "x needs grad",
                        "w_column_major": "w column-major"}


def local_check(op: str, x2: torch.Tensor, w: torch.Tensor, chunks) -> MatmulCheck:
    """This rank's :class:`MatmulCheck`, once its own input passed the local checks."""
    check_chunks(op, chunks)
    if not isinstance(x2, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: x and w must be tensors, got {type(x2).__name__} and "
                        f"{type(w).__name__}")
    check_float(op, x2, w)
    if x2.dim() != 2:
        raise ValueError(f"{op}: x must be [..., K], got a scalar")
    if w.dim() != 2 or w.shape[0] != x2.shape[1]:
        raise ValueError(f"{op}: x has K={x2.shape[1]} columns but w is {tuple(w.shape)}; "
                         "w must be [K, N]")
    return MatmulCheck(dtype_code(x2.dtype), x2.shape[0], w.shape[1], chunks_code(chunks),
                       x2.shape[1], int(_column_major(w)))


def _column_major(w: torch.Tensor) -> bool:
    """w laid out as ``weight.t()`` of a contiguous [N, K] (what row-parallel layers pass)."""
    return w.stride(0) == 1 and (w.shape[1] == 1 or w.stride(1) >= w.shape[0])


def _plan(op: str, x2: torch.Tensor, w: torch.Tensor, chunks, ctx: OpsContext,
          wgrad_into: torch.Tensor | None = None) -> tuple[Decision, bool]:
    """The decision, and whether a GEMV holds its output transposed: only when every
    rank's w is column-major, since all ranks must reduce buffers of the same layout."""
    def local():
        check = local_check(op, x2, w, chunks)
        _check_wgrad_into(op, w, wgrad_into)
        return check.row()
    row, problem = attempt(local)
    rows = ctx.gather_meta(op, MatmulCheck.width(0), row, problem,
                           lambda rows: MatmulCheck.agree(op, rows))
    return _decide(op, rows, x2.element_size(), chunks, ctx)


def _check_wgrad_into(op: str, w: torch.Tensor, wgrad_into: torch.Tensor | None) -> None:
    if wgrad_into is not None and tuple(wgrad_into.shape) != (w.shape[1], w.shape[0]):
        raise ValueError(f"{op}: wgrad_into {tuple(wgrad_into.shape)} is not the "
                         f"transposed shape of w {tuple(w.shape)}")


def _decide(op: str, rows, itemsize: int, chunks, ctx: OpsContext) -> tuple[Decision, bool]:
    """``_plan`` from every rank's :class:`MatmulCheck` row (or a :class:`DgradCheck`'s),
    once gathered."""
    MatmulCheck.agree(op, rows)
    checks = MatmulCheck.from_rows([row[:MatmulCheck.width(0)] for row in rows])
    world, m, n = len(checks), checks[0].M, checks[0].N
    k_max = max(c.K_r for c in checks)
    wire = 2 * (world - 1) / world * m * n * itemsize
    gemv = m <= GEMV_ROWS  # pieces cut N: [M, N_j] each
    work = Work(flops=2.0 * m * k_max * n, wire_bytes=wire, kind="all_reduce",
                length=n if gemv else m, width=m if gemv else n, columns=gemv)
    return ctx.decide(op, chunks, work=work, rows=work.length), \
        all(c.w_column_major for c in checks)


def _fused_forward(x2: torch.Tensor, w: torch.Tensor, group, decision: Decision,
                   transposed: bool, meanwhile=None, in_flight: list | None = None,
                   check: Carried | None = None) -> torch.Tensor:
    """[M, K_r] @ [K_r, N] → all-reduced [M, N]; pieces overlap their all_reduce.

    ``meanwhile``: called once every piece is on the wire, before waiting for them (a
    backward computes its weight gradient there, under the last pieces' all_reduce).
    ``in_flight``: a list the pieces' pending collectives are put in instead of being
    waited for (the output is not ready until they are); a GEMV still waits for every
    block.
    """
    m, n = x2.shape[0], w.shape[1]
    if decision.path == "fallback":
        # a GEMV with a column-major w is made transposed ([N, M], BLAS's fast orientation
        # here, see _gemv_pieces), reduced so, and returned as the [M, N] view of it; one
        # row is the same bytes either way (a decoding step's: five tensor views saved a call)
        flip = transposed and 1 < m <= GEMV_ROWS
        mover = transport_of(group)
        if mover.lends_slots and meanwhile is None:  # done when it returns
            # shared memory: the product is made in the slot its peers read (the compute
            # region around the product alone: waiting for a peer is not this rank's compute)
            out = mover.reduce_computed(_product(x2, w, flip), (n, m) if flip else (m, n), x2,
                                        check=check)
            return out.t() if flip else out
        if flip and in_flight is None:
            buf = x2.new_empty(n, m)
            with piece():
                torch.mm(x2, w, out=buf.t())
            _waited(buf, [mover.all_reduce(buf, async_op=meanwhile is not None)], meanwhile)
            return buf.t()
        with piece():
            out = x2 @ w
        asynchronous = meanwhile is not None or in_flight is not None
        works = [mover.all_reduce(out, async_op=asynchronous)]
        return _waited(out, works, meanwhile, in_flight)
    if m <= GEMV_ROWS:
        return _gemv_pieces(x2, w, group, decision.chunks, transposed, meanwhile)
    bounds = offsets(tapered(m, decision.chunks))
    out = x2.new_empty(m, n)  # the collective's buffer is the output
    works = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        with piece():
            torch.matmul(x2[lo:hi], w, out=out[lo:hi])
        works.append(transport_of(group).all_reduce(out[lo:hi], async_op=True))
    return _waited(out, works, meanwhile, in_flight)


def _product(x2: torch.Tensor, w: torch.Tensor, flip: bool):
    """``fill(out)``: ``x2 @ w`` into ``out`` ([N, M] and written as its transpose where
    ``flip``), inside the compute region where one is open (nothing to enter otherwise: a
    decoding step)."""
    timed = current_region() is not None

    def fill(out: torch.Tensor) -> None:
        target = out.t() if flip else out
        if timed:
            with piece():
                torch.mm(x2, w, out=target)
        else:
            torch.mm(x2, w, out=target)
    return fill


def _waited(out: torch.Tensor, works, meanwhile, in_flight: list | None = None) -> torch.Tensor:
    """Run ``meanwhile`` (if any) while ``works`` are in flight, wait for them, give ``out``;
    or, given ``in_flight``, leave them there for the caller to wait for."""
    if meanwhile is not None:
        meanwhile()
    if in_flight is not None:
        in_flight.extend(w for w in works if w is not None)
        return out
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
    [N, M] buffer, the result is that buffer's ``[M, N]`` view (M ≤ 8 rows); BLAS also
    runs this orientation about 2x faster here than x2 @ w.
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
        works.append(transport_of(group).all_reduce(block, async_op=True))
        blocks.append(block)
    _waited(buf, works, meanwhile)
    return buf.t() if transposed else torch.cat(blocks, dim=1)


class InFlight:
    """An operator's output whose last pieces may still be on the wire: read it through
    ``wait()`` (every rank must, before the group's next collective could depend on it)."""

    def __init__(self, out: torch.Tensor, works: list):
        self._out, self._works = out, works

    def wait(self) -> torch.Tensor:
        while self._works:
            self._works.pop(0).wait()
        return self._out


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, group, decision, transposed, wgrad_into, in_flight, check, ops_ctx):
        ctx.save_for_backward(x2, w)
        ctx.region, ctx.wgrad_into, ctx.ops_ctx = current_region(), wgrad_into, ops_ctx
        out = _fused_forward(x2, w, group, decision, transposed, in_flight=in_flight,
                             check=check)
        # a view (a GEMV's transposed buffer) returned from here could not be modified in
        # place by the caller (autograd forbids it for a custom Function's views): a copy,
        # only where a backward follows (a decoding step keeps the view)
        return out.clone() if out._base is not None else out

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
            defer(ctx.ops_ctx, wgrad)
        return dx, dw, None, None, None, None, None, None, None


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
    Under ``torch.compile``: one registered op (``plait::matmul_all_reduce``), the pieces,
    decision and check inside it; its weight gradient through autograd.
    """
    if torch.compiler.is_compiling():
        return traced_matmul_all_reduce(x, w, group, chunks)
    return matmul_all_reduce_start(x, w, group, chunks=chunks, ctx=ctx,
                                   wgrad_into=wgrad_into).wait()


def matmul_all_reduce_start(x: torch.Tensor, w: torch.Tensor, group=None, *, chunks="auto",
                            ctx: OpsContext | None = None,
                            wgrad_into: torch.Tensor | None = None) -> InFlight:
    """``matmul_all_reduce``, returned once every piece is computed and on the wire:
    ``.wait()`` gives the result. Between the two the caller may compute anything that
    does not read the result, and start other collectives on the group (they queue
    behind these pieces); the backward is the same as ``matmul_all_reduce``'s."""
    ctx = ctx or get_context(group)
    x2 = as_rows(x) if isinstance(x, torch.Tensor) and x.dim() else x  # [M, K_r]
    if chunks == "auto" and carries_checks(ctx):
        # shared memory takes the plain path at "auto" (OpsContext.decide): the check rides
        # in the header of the call that carries the product, not in a call of its own
        key = signature(OP, x2, w)
        if key is not None and wgrad_into is not None:
            key = (*key, tuple(wgrad_into.shape))
        plan, problem = ctx.carried_plan(key, lambda: _carried(x2, w, chunks, wgrad_into))
        if problem is not None:
            ctx.gather_meta(OP, MatmulCheck.width(0), None, problem)  # raises on every rank
        decision = ctx.decide(OP, chunks, work=None, rows=x2.shape[0])
        return _started(x, x2, w, group, decision, *plan, wgrad_into, ctx)
    decision, transposed = _plan(OP, x2, w, chunks, ctx, wgrad_into)
    return _started(x, x2, w, group, decision, transposed, None, wgrad_into, ctx)


def _carried(x2: torch.Tensor, w: torch.Tensor, chunks,
             wgrad_into: torch.Tensor | None = None) -> tuple[bool, tuple]:
    """Whether the product is held transposed, and the check the data call carries.

    A GEMV's product (2 to GEMV_ROWS rows) is made transposed where w is column-major
    (BLAS's fast orientation here): every rank's slot must hold one layout, so there the
    layout is one more field every rank must agree on."""
    check = local_check(OP, x2, w, chunks)
    _check_wgrad_into(OP, w, wgrad_into)
    flipped = 1 < x2.shape[0] <= GEMV_ROWS  # one row: the same bytes either way
    agreed = (*MatmulCheck.AGREED, "w_column_major") if flipped else MatmulCheck.AGREED
    return flipped and bool(check.w_column_major), Carried(
        OP, MatmulCheck.names(), check.row(), lambda rows: MatmulCheck.agree(OP, rows, agreed))


def _started(x, x2, w, group, decision, transposed, check, wgrad_into, ops_ctx) -> InFlight:
    """The forward, through autograd where a backward follows, else alone (a decoding
    step: nothing to save); in x's leading shape."""
    works: list = []
    if torch.is_grad_enabled() and (x2.requires_grad or w.requires_grad):
        out = _MatmulAllReduce.apply(x2, w, group, decision, transposed, wgrad_into, works,
                                     check, ops_ctx)
    else:
        out = _fused_forward(x2, w, group, decision, transposed, in_flight=works, check=check)
    return InFlight(out.reshape(*x.shape[:-1], w.shape[1]) if x.dim() != 2 else out, works)


class _ColumnParallelMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, group, chunks, ops_ctx, agreed):
        ctx.save_for_backward(x2, w)
        ctx.group, ctx.chunks, ctx.ops_ctx = group, chunks, ops_ctx
        ctx.region = current_region()
        with piece():
            y = x2 @ w
        if agreed is not None:  # it travelled under the GEMM
            ctx.metas = agreed()
            same_dgrad(ctx.metas)
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w = ctx.saved_tensors
        with compute_region(ctx.region):
            dx, dw = _column_backward(x2, w, dy, ctx.group, ctx.chunks, ctx.ops_ctx, ctx.metas,
                                      *ctx.needs_input_grad[:2])
        return dx, dw, None, None, None, None


def _column_backward(x2: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, group, chunks,
                     ops_ctx: OpsContext, metas, needs_dx: bool, needs_dw: bool):
    """``column_parallel_matmul``'s backward, ``(dx, dw)`` (None where not needed): the dgrad
    ``Σ_ranks dy_r @ w_rᵀ`` fused, the weight's gradient ``x2ᵀ dy`` (and any deferred one)
    under its last pieces' all-reduce. ``metas``: every rank's :class:`DgradCheck` row, agreed."""
    grads = {}

    def wgrad():  # under the dgrad's last all_reduces, with what was deferred
        if needs_dw:
            with piece():
                grads["dw"] = x2.t() @ dy
        run_deferred(ops_ctx)
    if not needs_dx:
        wgrad()
        return None, grads.get("dw")
    decision, transposed = _decide(DGRAD, metas, dy.element_size(), chunks, ops_ctx)
    dx = _fused_forward(dy.contiguous(), w.t(), group, decision, transposed, meanwhile=wgrad)
    return dx, grads.get("dw")


DGRAD = "column_parallel_matmul.dgrad"


def dgrad_check(x2: torch.Tensor, w: torch.Tensor, chunks, needs_dgrad: bool) -> DgradCheck:
    """This rank's :class:`DgradCheck`, once its own input passed the local checks."""
    local_check("column_parallel_matmul", x2, w, chunks)
    return DgradCheck(dtype_code(x2.dtype), x2.shape[0], x2.shape[1], chunks_code(chunks),
                      w.shape[1], int(_column_major(w.t())), int(needs_dgrad))


def same_dgrad(rows) -> None:
    """Raise on every rank where the ranks' :class:`DgradCheck` rows differ."""
    DgradCheck.agree(DGRAD, rows)


def column_parallel_matmul(x: torch.Tensor, w: torch.Tensor, group=None, *, chunks="auto",
                           ctx: OpsContext | None = None) -> torch.Tensor:
    """``x @ w_r`` forward (x replicated); backward's dgrad is a fused ``matmul_all_reduce``.

    The forward computes locally. With gradients enabled, the backward's cross-rank
    check is made here, its small gather travelling under the local GEMM, so the
    backward's all-reduce starts without one; it includes whether x needs a gradient,
    so a rank whose x does not (and will skip that all-reduce) is refused everywhere.
    Under ``torch.no_grad()`` nothing crosses ranks: local checks only. Under
    ``torch.compile``: the local GEMM, its backward's dgrad the registered fused op.
    """
    if torch.compiler.is_compiling():
        return traced_column_matmul(x, w, group, chunks)
    ctx = ctx or get_context(group)
    x2 = as_rows(x) if isinstance(x, torch.Tensor) and x.dim() else x  # [M, K_r]
    agreed = None
    if torch.is_grad_enabled():
        row, problem = attempt(lambda: dgrad_check(x2, w, chunks, x.requires_grad).row())
        agreed = ctx.start_meta(DGRAD, DgradCheck.width(0), row, problem)
        if problem is not None:
            agreed()  # raises on every rank
    else:
        local_check("column_parallel_matmul", x2, w, chunks)  # no backward all-reduce
    out = _ColumnParallelMatmul.apply(x2, w, group, chunks, ctx, agreed)
    return out.reshape(*x.shape[:-1], w.shape[1]) if x.dim() != 2 else out


# --- under torch.compile: one registered op (plait.ops.library) ------------------------
def _registered(x: torch.Tensor, w: torch.Tensor, group: str, chunks: int) -> torch.Tensor:
    """The op's kernel: Σ_ranks x_r @ w_r through the fused operator (``chunks`` 0:
    ``"auto"``); contiguous (a GEMV's product may be a transposed buffer)."""
    with torch.no_grad():
        out = matmul_all_reduce(x, w, group_of(group), chunks="auto" if chunks == 0 else chunks)
    return out.contiguous()


define("matmul_all_reduce(Tensor x, Tensor w, str group, int chunks) -> Tensor", _registered,
       lambda x, w, group, chunks: x.new_empty(*x.shape[:-1], w.shape[1]))


class _Traced(torch.autograd.Function):
    """dy is replicated (every rank computed the same loss from the sum): each rank's
    gradients are its own, and no bytes move."""

    @staticmethod
    def forward(ctx, x, w, group: str, chunks: int):
        ctx.save_for_backward(x, w)
        return torch.ops.plait.matmul_all_reduce(x, w, group, chunks)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dy @ w.t() if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])
        return dx, dw, None, None


def traced_matmul_all_reduce(x: torch.Tensor, w: torch.Tensor, group, chunks) -> torch.Tensor:
    """``plait::matmul_all_reduce`` with its gradient, for traced code (``chunks`` an int or
    ``"auto"``)."""
    return _Traced.apply(x, w, group_key(group), 0 if chunks == "auto" else int(chunks))


def _column_grads(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, group: str, chunks: int
                  ) -> list[torch.Tensor]:
    """The op's kernel: eager ``column_parallel_matmul``'s backward, ``[dx, dw]``: the dgrad
    ``Σ_ranks dy_r @ w_rᵀ`` fused (its check first), the weight's gradient ``xᵀ dy``
    computed under its last pieces' all-reduce."""
    g, auto = group_of(group), "auto" if chunks == 0 else chunks
    ctx = get_context(g)
    x2, dy2 = as_rows(x), as_rows(dy)
    row, problem = attempt(lambda: dgrad_check(x2, w, auto, True).row())
    metas = ctx.gather_meta(DGRAD, DgradCheck.width(0), row, problem)
    same_dgrad(metas)
    with torch.no_grad():
        dx, dw = _column_backward(x2, w, dy2, g, auto, ctx, metas, True, True)
    return [dx.reshape(x.shape).contiguous(), dw.contiguous()]


define("column_grads(Tensor x, Tensor w, Tensor dy, str group, int chunks) -> Tensor[]",
       _column_grads, lambda x, w, dy, group, chunks: [x.new_empty(x.shape), w.new_empty(w.shape)])


class _ColumnTraced(torch.autograd.Function):
    """x replicated, w this rank's columns: ``x @ w`` locally; the backward is eager
    plait's as one registered op (``plait::column_grads``): the dgrad fused, its pieces on
    the wire as computed, the weight's gradient under the last of them."""

    @staticmethod
    def forward(ctx, x, w, group: str, chunks: int):
        ctx.save_for_backward(x, w)
        ctx.group, ctx.chunks = group, chunks
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = torch.ops.plait.column_grads(x, w, dy, ctx.group, ctx.chunks)
        return dx, dw, None, None


def traced_column_matmul(x: torch.Tensor, w: torch.Tensor, group, chunks) -> torch.Tensor:
    """``x @ w`` with x replicated and w [K, N_r] this rank's columns, for traced code: the
    backward's dgrad one registered fused ``matmul_all_reduce`` (``chunks`` an int or
    ``"auto"``)."""
    return _ColumnTraced.apply(x, w, group_key(group), 0 if chunks == "auto" else int(chunks))

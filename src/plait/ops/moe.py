"""All-to-All + GEMM and GEMM + All-to-All: expert-parallel mixture of experts.

``all_to_all_matmul`` (dispatch): ``y[(s, e)] = all_to_all(x)[(s, e)] @ w[e]``
``matmul_all_to_all`` (combine):  ``out = all_to_all(y[(s, e)] @ w[e])`` back to the senders

=============  ======================  ==============================================
tensor         shape on rank r         note
=============  ======================  ==============================================
send_counts    [W][E_d]                tokens this rank sends rank d's expert e
recv_counts    [W][E_r]                tokens rank s sends this rank's expert e;
                                       send_counts[d] on r == recv_counts[r] on d
x              [T_send, H]             dispatch input, rows by (destination, expert)
w (dispatch)   [E_r, H, F]             this rank's experts; E_r may differ per rank
y              [T_recv, F]             rows by (source, expert); T_recv = Σ recv_counts
w (combine)    [E_r, F, H]
out            [T_send, H]             combine output, in x's row order
=============  ======================  ==============================================

Counts are uneven and change every call (any may be 0).

Backward. dispatch: dgrad ``dx = combine(dy, wᵀ)`` (fused: ``matmul_all_to_all`` with
``w.transpose(1, 2)``); wgrad ``dw[e] = Σ_s x_(s,e)ᵀ dy_(s,e)`` over the tokens kept
from the forward, computed while dx's pieces are on the wire. combine: dgrad
``dy = dispatch(dout, wᵀ)`` (fused: ``all_to_all_matmul``); wgrad
``dw[e] = Σ_s y_(s,e)ᵀ dout_(s,e)``, each term added as its gradient block
arrives. Every sum runs in a fixed order, so repeated runs agree bit for bit.

Schedule. Every peer's block is cut into the same number of row pieces; piece j is one
``all_to_all_single`` carrying piece j of every peer's block (zero rows where a peer has
none: deadlock-free on NCCL). Dispatch: every piece starts at once; the own block is
multiplied from x, then each piece as it lands, into its rows of y. Combine: piece j's rows
are multiplied into its send buffer and start while piece j+1 is computed; the own block
last. One piece is the plain path. Moved data is bit-identical to it; a GEMM on row pieces
may round differently from the whole block (~1e-16 relative in float64).

Checks. Before any token moves, one small all_gather per call carries every rank's verdict
on its input, its dtype and dims, and per peer its token totals and a fingerprint of its
per-expert counts, so a mismatch raises the same error everywhere. ``ctx.validate ==
"never"`` skips it, unless ``chunks="auto"`` needs the counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from .context import OpsContext, attempt, get_context, transport_of
from ..perf.pieces import Work
from .agree import Check, check_chunks, chunks_code, dtype_code
from .exchange import start_all_to_all
from .library import group_key, group_of, opaque, opaque_key
from .pieces import check_float, offsets, row_parts

__all__ = ["all_to_all_matmul", "matmul_all_to_all", "RoutesCheck"]


@dataclass(frozen=True)
class _Routes:
    """Who sends whom how many tokens for which expert (dispatch direction)."""

    rank: int
    world: int
    send: tuple[tuple[int, ...], ...]   # send[d][e]: rows of x for rank d's expert e
    recv: tuple[tuple[int, ...], ...]   # recv[s][e]: rows of y from rank s for my expert e
    traffic: tuple[tuple[int, ...], ...] | None  # every rank's rows to every rank, if gathered

    @property
    def send_rows(self) -> list[int]:
        return [sum(c) for c in self.send]

    @property
    def recv_rows(self) -> list[int]:
        return [sum(c) for c in self.recv]

    def estimate(self, k: int, n: int, element: int, combine: bool) -> Work:
        """The busiest rank's call as the pieces model prices it (nothing, where the counts
        were not gathered: a fixed piece count was asked for, and no model is needed).

        Its own tokens need no wire: a dispatch multiplies them first, beside the pieces'
        transfers (``lead_flops``; its plain path moves everything, then multiplies), a
        combine last, beside the last pieces (``tail_flops``). Priced as if every row
        waited for the wire, 2 pieces of a compute-heavy combine (F 1024) were priced about
        50 % over their measured time, and 8 pieces looked best where 4 and 5 ran as fast.
        """
        if self.traffic is None:
            return Work(flops=0.0, wire_bytes=0.0)
        s, world = self.traffic, self.world
        received = [sum(s[a][b] for a in range(world)) for b in range(world)]
        busiest = max(range(world), key=received.__getitem__)
        own = s[busiest][busiest]
        moved = [sum(s[b][a] if combine else s[a][b] for b in range(world) if b != a)
                 for a in range(world)]
        width = n if combine else k
        per_row = 2.0 * k * n
        return Work(flops=per_row * (received[busiest] - own),
                    wire_bytes=float(max(moved) * width * element),
                    receive=not combine, lead_flops=0.0 if combine else per_row * own,
                    tail_flops=per_row * own if combine else 0.0, lead_in_plain=False)

    def largest_block(self) -> int:
        """The most rows one rank sends another (pieces cut blocks: no more pieces than this)."""
        if self.traffic is None:
            return 1 << 30  # counts not gathered: the asked-for chunks, uncapped
        s, world = self.traffic, self.world
        return max([s[a][b] for a in range(world) for b in range(world) if a != b] + [1])


def _multiply(src, counts, a, dst, dst_at, w, on_block=None):
    """Rows [a, a + len(src)) of a block ordered by expert (``counts``): ``src_e @ w[e]``
    into ``dst[dst_at + lo : dst_at + hi]`` for block rows [lo, hi) of expert e."""
    at = 0
    for e, c in enumerate(counts):
        lo, hi = max(at, a), min(at + c, a + src.shape[0])
        at += c
        if hi <= lo:
            continue
        rows = src[lo - a:hi - a]
        if w is not None:
            torch.matmul(rows, w[e], out=dst[dst_at + lo:dst_at + hi])
        if on_block is not None:
            on_block(rows, e, dst_at + lo, dst_at + hi)


# --- the two exchanges (each is the other's backward) --------------------------

def _dispatch(x, w, routes: _Routes, chunks: int, group, on_block=None):
    """x rows (d, e) → [T_recv, N] rows (s, e), each block ``x_block @ w[e]`` as it lands.

    ``w`` None: only move the tokens (``on_block`` still sees each block).
    ``on_block(rows, e, lo, hi)``: received tokens ``rows`` are output rows [lo, hi) of expert e.
    """
    rank, world = routes.rank, routes.world
    send_rows, recv_rows = routes.send_rows, routes.recv_rows
    xs, ys = offsets(send_rows), offsets(recv_rows)
    width = x.shape[1] if w is None else w.shape[2]
    y = x.new_empty(ys[-1], width)
    if chunks == 1:
        recv = x
        if world > 1:
            recv = x.new_empty(ys[-1], x.shape[1])
            transport_of(group).all_to_all(recv, x, recv_rows, send_rows)
        for s in range(world):
            _multiply(recv[ys[s]:ys[s + 1]], routes.recv[s], 0, y, ys[s], w, on_block)
        return y
    out_parts = [row_parts(n, chunks) for n in send_rows]
    in_parts = [row_parts(n, chunks) for n in recv_rows]
    out_at, in_at = [offsets(p) for p in out_parts], [offsets(p) for p in in_parts]
    pending = []
    for j in range(chunks):  # nothing to compute before sending: every piece starts now
        blocks = [x[xs[d] + out_at[d][j]:xs[d] + out_at[d][j] + out_parts[d][j]]
                  for d in range(world) if d != rank]
        # piece j of every peer's rows, adjacent: a copy, except with one peer (2 ranks),
        # where that peer's rows are already one contiguous slice of x
        send = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        recv = x.new_empty(sum(in_parts[s][j] for s in range(world) if s != rank), x.shape[1])
        work = start_all_to_all(recv, send,
                                [0 if s == rank else in_parts[s][j] for s in range(world)],
                                [0 if d == rank else out_parts[d][j] for d in range(world)], group)
        pending.append((work, recv, j, send))  # send: alive until done
    # own block first: it needs no wire
    _multiply(x[xs[rank]:xs[rank + 1]], routes.recv[rank], 0, y, ys[rank], w, on_block)
    for work, recv, j, _ in pending:
        work.wait()
        at = 0
        for s in range(world):
            n = in_parts[s][j]
            if s == rank or n == 0:
                continue
            a = in_at[s][j]
            _multiply(recv[at:at + n], routes.recv[s], a, y, ys[s], w, on_block)
            at += n
    return y


def _combine(y, w, routes: _Routes, chunks: int, group, idle: Callable[[], None] | None = None):
    """y rows (s, e) → [T_send, N] rows (d, e): each block ``y_block @ w[e]`` back to its sender.

    ``idle()`` runs once every piece is on the wire (the caller's wgrad overlaps them).
    """
    rank, world = routes.rank, routes.world
    send_rows, recv_rows = routes.send_rows, routes.recv_rows
    xs, ys = offsets(send_rows), offsets(recv_rows)
    width = w.shape[2]
    if chunks == 1:
        send = y.new_empty(ys[-1], width)
        for s in range(world):
            _multiply(y[ys[s]:ys[s + 1]], routes.recv[s], 0, send, ys[s], w)
        out = send
        if world > 1:
            out = y.new_empty(xs[-1], width)  # the receive buffer is the output
            transport_of(group).all_to_all(out, send, send_rows, recv_rows)
        if idle is not None:
            idle()
        return out
    out = y.new_empty(xs[-1], width)
    back_parts = [row_parts(n, chunks) for n in recv_rows]   # to each source s
    home_parts = [row_parts(n, chunks) for n in send_rows]   # from each expert owner d
    back_at, home_at = [offsets(p) for p in back_parts], [offsets(p) for p in home_parts]
    pending = []
    for j in range(chunks):
        send = y.new_empty(sum(back_parts[s][j] for s in range(world) if s != rank), width)
        at = 0
        for s in range(world):
            n = back_parts[s][j]
            if s == rank or n == 0:
                continue
            a = back_at[s][j]
            _multiply(y[ys[s] + a:ys[s] + a + n], routes.recv[s], a, send, at - a, w)
            at += n
        recv = _landing(out, xs, home_parts, home_at, j, rank, world, width)
        work = start_all_to_all(recv, send,
                                [0 if d == rank else home_parts[d][j] for d in range(world)],
                                [0 if s == rank else back_parts[s][j] for s in range(world)], group)
        pending.append((work, recv, j, send))  # send: alive until done
    # own block last: it needs no wire, and overlaps the last pieces' transfers
    _multiply(y[ys[rank]:ys[rank + 1]], routes.recv[rank], 0, out, xs[rank], w)
    if idle is not None:
        idle()
    for work, recv, j, _ in pending:
        work.wait()
        if recv._base is out or recv.numel() == 0:
            continue  # it landed in place
        at = 0
        for d in range(world):
            n = home_parts[d][j]
            if d != rank and n:
                row = xs[d] + home_at[d][j]
                out[row:row + n].copy_(recv[at:at + n])
                at += n
    return out


def _landing(out, xs, home_parts, home_at, j, rank, world, width):
    """Where piece j's arrivals land: straight in the output when one peer sends them (its
    rows are one contiguous slice there), else a buffer copied into place on arrival."""
    peers = [d for d in range(world) if d != rank and home_parts[d][j]]
    if len(peers) == 1:
        row = xs[peers[0]] + home_at[peers[0]][j]
        return out[row:row + home_parts[peers[0]][j]]
    return out.new_empty(sum(home_parts[d][j] for d in range(world) if d != rank), width)


# --- checks and plan -----------------------------------------------------------

def _count_table(op: str, name: str, counts) -> list[list[int]]:
    if isinstance(counts, torch.Tensor):
        if counts.dim() != 2 or counts.dtype.is_floating_point or counts.dtype == torch.bool:
            raise TypeError(f"{op}: {name} must be a 2-D integer tensor, got "
                            f"{counts.dtype} of shape {tuple(counts.shape)}")
        counts = counts.tolist()
    try:
        table = [list(row) for row in counts]
    except TypeError:
        raise TypeError(f"{op}: {name} must be [world][experts] integers, got {counts!r}") from None
    for row in table:
        for c in row:
            if not isinstance(c, int) or isinstance(c, bool):
                raise TypeError(f"{op}: {name} must hold integers, got {c!r} in {table}")
            if c < 0:
                raise ValueError(f"{op}: {name} {table} has a negative count")
    return table


def _check_local(op, inp, w, send_counts, recv_counts, world, chunks, combine):
    name, want = (("y", "[T_recv, F] and w [E, F, H]") if combine
                  else ("x", "[T_send, H] and w [E, H, F]"))
    if not isinstance(inp, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise TypeError(f"{op}: {name} and w must be tensors, got {type(inp).__name__} and "
                        f"{type(w).__name__}")
    check_float(op, inp, w)
    if inp.dim() != 2 or w.dim() != 3 or w.shape[1] != inp.shape[1]:
        raise ValueError(f"{op}: {name} {tuple(inp.shape)} and w {tuple(w.shape)} do not chain; "
                         f"need {name} {want}")
    check_chunks(op, chunks)
    send = _count_table(op, "send_counts", send_counts)
    recv = _count_table(op, "recv_counts", recv_counts)
    if len(send) != world:
        raise ValueError(f"{op}: send_counts has {len(send)} rows for {world} ranks")
    if len(recv) != world or any(len(row) != w.shape[0] for row in recv):
        raise ValueError(f"{op}: recv_counts must be [{world}][{w.shape[0]}] (a row per source "
                         f"rank, a column per expert of w), got rows of {[len(r) for r in recv]}")
    counted, which = (recv, "recv_counts") if combine else (send, "send_counts")
    total = sum(map(sum, counted))
    if total != inp.shape[0]:
        raise ValueError(f"{op}: {which} sum to {total}, but {name} has {inp.shape[0]} rows")
    return send, recv


def _digest(counts: Sequence[int]) -> int:
    """A 31-bit fingerprint of one count row (its length included) for the cross-rank check
    (31 bits: a shared-memory header holds 32-bit words; the row's total is checked too)."""
    h = len(counts)
    for c in counts:
        h = (h * 1_000_003 + c + 1) % ((1 << 31) - 1)
    return h


@dataclass(frozen=True)
class RoutesCheck(Check):
    """An expert all-to-all's check: dtype, K, N, chunks and which gradients follow must
    agree; this rank's expert count may differ; per peer, the tokens it sends and receives
    and a fingerprint of each count row (:func:`_digest`), so every rank sees that what a
    sends b is what b expects from a."""

    dtype: int
    K: int
    N: int
    chunks: int
    x_needs_grad: int
    w_needs_grad: int
    experts: int
    sent: tuple
    received: tuple
    sent_digest: tuple
    received_digest: tuple
    AGREED: ClassVar = ("dtype", "K", "N", "chunks", "x_needs_grad", "w_needs_grad")
    PER_RANK: ClassVar = frozenset({"sent", "received", "sent_digest", "received_digest"})
    LABELS: ClassVar = {"x_needs_grad": "input needs grad", "w_needs_grad": "w needs grad"}


def _plan(op, inp, w, send_counts, recv_counts, group, chunks, ctx: OpsContext, combine: bool):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts, problem = attempt(lambda: _check_local(op, inp, w, send_counts, recv_counts, world,
                                                   chunks, combine))
    if ctx.validate == "never" and chunks != "auto":  # nothing global needed: no check either
        if problem is not None:
            raise problem
        return _Routes(rank, world, *(tuple(map(tuple, c)) for c in counts), None)
    row = []
    if problem is None:
        send, recv = counts
        grads = torch.is_grad_enabled()
        row = RoutesCheck(dtype_code(inp.dtype), inp.shape[1], w.shape[2], chunks_code(chunks),
                          int(grads and inp.requires_grad), int(grads and w.requires_grad),
                          w.shape[0], tuple(map(sum, send)), tuple(map(sum, recv)),
                          tuple(map(_digest, send)), tuple(map(_digest, recv))).row()
    metas = ctx.gather_meta(op, RoutesCheck.width(world), row, problem)  # counts change: each call
    RoutesCheck.agree(op, metas)
    checks = RoutesCheck.from_rows(metas)
    for a, ca in enumerate(checks):  # what a sends b is what b receives from a
        for b, cb in enumerate(checks):
            if ca.sent[b] != cb.received[a] or ca.sent_digest[b] != cb.received_digest[a]:
                _explain_mismatch(op, group, counts, [c.experts for c in checks])
    rows = [c.sent for c in checks]  # rows[a][b]: tokens rank a sends rank b
    return _Routes(rank, world, tuple(map(tuple, send)), tuple(map(tuple, recv)),
                   tuple(map(tuple, rows)))


def _explain_mismatch(op, group, counts, experts):
    """Some pair's counts disagree (every rank knows): fetch them all, name the first pair."""
    everyone = [None] * len(experts)
    dist.all_gather_object(everyone, counts, group=group)
    for a, (send, _) in enumerate(everyone):
        for b, (_, recv) in enumerate(everyone):
            if len(send[b]) != experts[b]:
                raise ValueError(f"{op}: rank {a}'s send_counts row {b} has {len(send[b])} "
                                 f"entries, but rank {b} has {experts[b]} experts")
            if send[b] != recv[a]:
                raise ValueError(f"{op}: rank {a} sends rank {b} {send[b]} tokens per expert "
                                 f"(send_counts[{b}]), but rank {b} expects {recv[a]} "
                                 f"(recv_counts[{a}])")
    raise AssertionError(f"{op}: count fingerprints differ but the counts agree")


def _decide(ctx: OpsContext, op, chunks, routes: _Routes, k, n, element, combine):
    # dispatch: blocks arrive, then are multiplied; combine: multiplied, then sent back
    return ctx.decide(op, chunks, rows=routes.largest_block(),
                      work=routes.estimate(k, n, element, combine))


# --- autograd ------------------------------------------------------------------

class _AllToAllMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, routes, decision, chunks, group, ops_ctx):
        kept = []
        keep = kept.append if ctx.needs_input_grad[1] else None
        y = _dispatch(x, w, routes, decision.chunks, group,
                      None if keep is None else lambda rows, e, lo, hi: keep((rows, e, lo, hi)))
        ctx.save_for_backward(w)
        ctx.kept, ctx.routes, ctx.chunks = kept, routes, chunks
        ctx.group, ctx.ops_ctx = group, ops_ctx
        return y

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        dy = dy.contiguous()
        dw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None

        def wgrad():  # fixed order: as the forward computed the blocks
            for rows, e, lo, hi in ctx.kept:
                dw[e].addmm_(rows.t(), dy[lo:hi])
        dx = None
        if ctx.needs_input_grad[0]:
            wt = w.transpose(1, 2)
            decision = _decide(ctx.ops_ctx, "all_to_all_matmul.dgrad", ctx.chunks, ctx.routes,
                               w.shape[2], w.shape[1], dy.element_size(), combine=True)
            dx = _combine(dy, wt, ctx.routes, decision.chunks, ctx.group,
                          idle=wgrad if dw is not None else None)
        elif dw is not None:
            wgrad()
        return dx, dw, None, None, None, None, None


class _MatmulAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, routes, decision, chunks, group, ops_ctx):
        ctx.save_for_backward(y, w)
        ctx.routes, ctx.chunks, ctx.group, ctx.ops_ctx = routes, chunks, group, ops_ctx
        return _combine(y, w, routes, decision.chunks, group)

    @staticmethod
    def backward(ctx, dout):
        y, w = ctx.saved_tensors
        dout = dout.contiguous()
        dw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None

        def wgrad(rows, e, lo, hi):  # each arriving gradient block, in arrival order
            dw[e].addmm_(y[lo:hi].t(), rows)
        wt = w.transpose(1, 2) if ctx.needs_input_grad[0] else None
        decision = _decide(ctx.ops_ctx, "matmul_all_to_all.dgrad", ctx.chunks, ctx.routes,
                           w.shape[2], w.shape[1], dout.element_size(), combine=False)
        dy = _dispatch(dout, wt, ctx.routes, decision.chunks, ctx.group,
                       wgrad if dw is not None else None)
        return (dy if ctx.needs_input_grad[0] else None), dw, None, None, None, None, None


def all_to_all_matmul(x: torch.Tensor, w: torch.Tensor, send_counts, recv_counts, group=None, *,
                      chunks="auto", ctx: OpsContext | None = None) -> torch.Tensor:
    """MoE dispatch: send token rows to their experts' ranks and multiply each block as it lands.

    ``x`` [T_send, H], rows by (destination rank, its local expert); ``send_counts[d][e]``
    rows go to rank d's expert e; ``recv_counts[s][e]`` rows arrive from rank s for
    local expert e of ``w`` [E, H, F]. Returns [T_recv, F], rows by (source, expert).
    ``chunks``: "auto" (cost model, see ``plait.ops.explain``) or a piece count; 1 is
    the plain path (all_to_all, then the GEMMs). Under ``torch.compile``: one registered
    op (``plait::opaque``) running this eagerly, the counts fixed in the graph (new counts
    compile again) and the group's own context.
    """
    if torch.compiler.is_compiling():  # one op, the counts fixed in the graph (Python ints)
        return opaque([x, w], opaque_key("all_to_all_matmul", _direct, _direct_like,
                                         _fixed(send_counts), _fixed(recv_counts),
                                         group_key(group), chunks, False))
    ctx = ctx or get_context(group)
    op = "all_to_all_matmul"
    routes = _plan(op, x, w, send_counts, recv_counts, group, chunks, ctx, combine=False)
    decision = _decide(ctx, op, chunks, routes, w.shape[1], w.shape[2], x.element_size(), False)
    return _AllToAllMatmul.apply(x, w, routes, decision, chunks, group, ctx)


def matmul_all_to_all(y: torch.Tensor, w: torch.Tensor, send_counts, recv_counts, group=None, *,
                      chunks="auto", ctx: OpsContext | None = None) -> torch.Tensor:
    """MoE combine: multiply each source's expert blocks and send each back as soon as computed.

    ``y`` [T_recv, F], rows by (source, expert) as ``all_to_all_matmul`` returns them;
    ``w`` [E, F, H]; the counts are the dispatch's (same meaning). Returns
    [T_send, H] in the dispatch input's row order. Under ``torch.compile``: as
    ``all_to_all_matmul``.
    """
    if torch.compiler.is_compiling():  # one op, the counts fixed in the graph (Python ints)
        return opaque([y, w], opaque_key("matmul_all_to_all", _direct, _direct_like,
                                         _fixed(send_counts), _fixed(recv_counts),
                                         group_key(group), chunks, True))
    ctx = ctx or get_context(group)
    op = "matmul_all_to_all"
    routes = _plan(op, y, w, send_counts, recv_counts, group, chunks, ctx, combine=True)
    decision = _decide(ctx, op, chunks, routes, w.shape[1], w.shape[2], y.element_size(), True)
    return _MatmulAllToAll.apply(y, w, routes, decision, chunks, group, ctx)


# --- called directly under torch.compile: one opaque op (plait.ops.library) --------------
def _fixed(counts) -> tuple:
    """Counts as nested tuples of ints (what a graph can hold as constants)."""
    return tuple(tuple(int(c) for c in row) for row in counts)


def _direct(t: torch.Tensor, w: torch.Tensor, send: tuple, recv: tuple, group: str, chunks,
            combine: bool) -> torch.Tensor:
    fn = matmul_all_to_all if combine else all_to_all_matmul
    return fn(t, w, [list(r) for r in send], [list(r) for r in recv], group_of(group),
              chunks=chunks)


def _direct_like(t: torch.Tensor, w: torch.Tensor, send: tuple, recv: tuple, group: str,
                 chunks, combine: bool) -> torch.Tensor:
    rows = sum(map(sum, send if combine else recv))
    return t.new_empty(rows, w.shape[2])

"""One operator at one shape on this rank, as ``plait bench ops`` times and checks it."""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..ops.pieces import offsets, row_parts
from ..ops.context import transport_of
from ..runtime.timing import agreed_max

__all__ = ["Case", "SLOTS", "check_outputs", "busiest_link_bytes", "all_to_all_pieces",
           "all_reduce_pieces", "all_gather_pieces"]

# one piece on the wire: its work handle, and what lands it in the case's buffer (or None)
Pending = list[tuple[object, Callable[[], None] | None]]

SLOTS = 2  # buffer sets: "beside" works on one while the other's first stage runs


class Case:
    """One operator at one shape on this rank: ``compute(slot)``, ``comm(async_op, slot)``,
    ``result(slot)``, ``run(chunks)``.

    ``compute`` and ``comm`` are the operator's two halves written with plain torch and
    torch.distributed calls (none of plait.ops), each on its own buffers of ``slot``: run
    one after the other (``comm_first`` says which first) they are the plain path, and
    ``result(slot)`` is then what the operator must return (:meth:`reference`). Slot 0
    serves the halves timed alone and the reference; :meth:`beside` alternates slots.
    """

    op = ""
    seed = 1234  # per case class: each draws its own inputs
    comm_first = False  # the plain path's order: compute, then the collective (a gather: reverse)

    def __init__(self, shape: dict, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gen = torch.Generator().manual_seed(self.seed + self.rank)
        self._ready, self._done = 0, None  # beside's slots: first stage done; last finished

    def randn(self, *size):
        return torch.randn(*size, generator=self.gen, dtype=self.dtype)

    def tolerance(self) -> float:
        return 1e-4

    def reference(self) -> torch.Tensor:
        """The plain path from the case's own halves, one after the other, in slot 0: what
        every timed variant must return (independent of plait.ops's code)."""
        self._first_stage(0)
        if self.comm_first:
            self.compute(slot=0)
        else:
            self.comm(slot=0)
        return self.result(0).clone()

    def start_beside(self) -> None:
        """The first stage of beside's next slot alone (untimed): the one it takes on."""
        self._first_stage(self._ready)

    def beside(self):
        """The compute and the plain path's transfer at once, neither waiting for the other
        (no data dependency): the best any schedule of this operator can do on this machine,
        where the transfer's own CPU work shares the cores with the compute.

        Each call finishes the plain path of the slot whose first stage ran in the call
        before (or in :meth:`start_beside`) while it runs the other slot's first stage: a
        gather's next buffer travels under the GEMM of the last one, the last product
        travels under the next one's compute. :meth:`beside_result` is the finished slot's
        result, the plain path's, one call late."""
        ready, fresh = self._ready, 1 - self._ready
        if self.comm_first:
            work = self.comm(async_op=True, slot=fresh)
            self.compute(slot=ready)
        else:
            work = self.comm(async_op=True, slot=ready)
            self.compute(slot=fresh)
        work.wait()
        self._ready, self._done = fresh, ready

    def beside_result(self) -> torch.Tensor:
        assert self._done is not None, "beside() has not run"
        return self.result(self._done)

    def _first_stage(self, slot: int) -> None:
        if self.comm_first:
            self.comm(slot=slot)
        else:
            self.compute(slot=slot)

    def plain(self):
        """Compute, then the collective (or the collective, then compute): the operator's
        own plain path (one piece)."""
        return self.run(1)

    def comm_pieces(self, pieces: int, slot: int = 0) -> Pending:
        """``comm``'s bytes as ``pieces`` collectives, all started at once (asynchronous)."""
        raise NotImplementedError

    def received(self, slot: int = 0) -> torch.Tensor:
        """The buffer ``comm`` writes (the one a check must see rewritten, not left over)."""
        raise NotImplementedError

    def plain_pieces(self, pieces: int) -> torch.Tensor:
        """The plain path with its transfer as ``pieces`` collectives in flight at once, none
        overlapping the compute (compute first; a gather: every piece first): how much of a
        fused operator's gain its pieces alone give, on a backend whose one big call is slow."""
        if not self.comm_first:
            self.compute(slot=0)
        for work, land in self.comm_pieces(pieces, slot=0):
            work.wait()
            if land is not None:
                land()
        if self.comm_first:
            self.compute(slot=0)
        return self.result(0)

    def link_bytes(self, host_of: Sequence[int]) -> float:
        """The fewest bytes any schedule of the collective must put through the busiest
        host link in one direction (rank r on host ``host_of[r]``; same on every rank).
        Default: the bytes each rank sends each other (:meth:`sent_bytes`) that cross hosts."""
        return busiest_link_bytes(self.sent_bytes(), host_of)

    def sent_bytes(self) -> list[list[float]]:
        """``[s][d]``: bytes rank s sends rank d (an all-to-all's; the same on every rank)."""
        raise NotImplementedError


def check_outputs(case: Case, outputs: dict[str, list[torch.Tensor]]
                  ) -> dict[str, tuple[float, bool]]:
    """Each variant's outputs against ``case.reference()``: name → (the largest
    |difference| over its outputs and every rank, ``inf`` for a wrong shape or dtype or a
    NaN; whether every rank's is within the case's tolerance, relative to its largest
    |reference|). The same on every rank."""
    reference = case.reference()
    # a variant that gave no output was not checked: not correct either
    diffs = [max((_max_diff(out, reference) for out in outs), default=float("inf"))
             for outs in outputs.values()]
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    limit = case.tolerance() * max(scale, 1.0)
    flags = [0.0 if d <= limit else 1.0 for d in diffs]  # each rank against its own scale
    agreed = agreed_max(diffs + flags, device=reference.device)
    n = len(diffs)
    return {name: (agreed[i], agreed[n + i] == 0.0) for i, name in enumerate(outputs)}


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dtype != b.dtype:
        return float("inf")
    diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return float("inf") if diff != diff else diff  # NaN: as wrong as it gets, and it orders


def busiest_link_bytes(sent: Sequence[Sequence[float]], host_of: Sequence[int]) -> float:
    """The most bytes that leave or enter one host (each direction apart: links are full
    duplex), of ``sent[s][d]`` bytes from rank s to rank d; ranks on one host use no link."""
    out: dict[int, float] = {h: 0.0 for h in host_of}
    into = dict(out)
    for s, row in enumerate(sent):
        for d, nbytes in enumerate(row):
            if host_of[s] != host_of[d]:
                out[host_of[s]] += nbytes
                into[host_of[d]] += nbytes
    return max([*out.values(), *into.values()], default=0.0)


def gather_equal(out: torch.Tensor, x: torch.Tensor, async_op: bool = False):
    """Every rank's ``x`` (the same rows on each) into ``out`` in rank order, on the group's
    transport (what the fused operators use: gloo or shared memory)."""
    return transport_of(None).all_gather(out, x, [x.shape[0]] * (out.shape[0] // x.shape[0]),
                                         async_op=async_op)


def all_to_all_equal(out: torch.Tensor, send: torch.Tensor, async_op: bool = False):
    """``all_to_all_single(out, send)`` (dim 0 cut alike for every rank) on the group's
    transport."""
    world = dist.get_world_size()
    return transport_of(None).all_to_all(out, send, [out.shape[0] // world] * world,
                                         [send.shape[0] // world] * world, async_op=async_op)


def all_reduce_pieces(buf: torch.Tensor, pieces: int) -> Pending:
    """``buf`` all-reduced as ``pieces`` row blocks in flight (views: nothing to land)."""
    at = offsets(row_parts(buf.shape[0], pieces))
    return [(transport_of(None).all_reduce(buf[lo:hi], async_op=True), None)
            for lo, hi in zip(at, at[1:])]


def all_gather_pieces(out: torch.Tensor, x: torch.Tensor, pieces: int) -> Pending:
    """Every rank's ``x`` ([R, ...], the same R on each) into ``out`` ([W·R, ...], rank
    order) as ``pieces`` gathers of a block of R's rows each, landed by a copy."""
    world, rows = out.shape[0] // x.shape[0], x.shape[0]
    at = offsets(row_parts(rows, pieces))
    pending: Pending = []
    for lo, hi in zip(at, at[1:]):
        buf = x.new_empty(world * (hi - lo), *x.shape[1:])  # [W·(hi-lo), ...]
        dst = out.view(world, rows, *x.shape[1:])[:, lo:hi]
        pending.append((gather_equal(buf, x[lo:hi], async_op=True),
                        lambda buf=buf, dst=dst: dst.copy_(buf.view_as(dst))))
    return pending


def all_to_all_pieces(recv: torch.Tensor, send: torch.Tensor, recv_rows: Sequence[int],
                      send_rows: Sequence[int], pieces: int) -> Pending:
    """``all_to_all_single(recv, send, recv_rows, send_rows)`` as ``pieces`` all-to-alls in
    flight: piece j carries the j-th part of every destination's rows (packed by a copy)
    and lands the j-th part of every source's (a copy back). Both ends cut a block of n
    rows alike (``row_parts(n, pieces)``), so each piece's counts agree across ranks."""
    send_parts = [row_parts(int(n), pieces) for n in send_rows]
    recv_parts = [row_parts(int(n), pieces) for n in recv_rows]
    send_at, recv_at = offsets(send_rows), offsets(recv_rows)
    pending: Pending = []
    for j in range(pieces):
        out_rows = [parts[j] for parts in send_parts]
        in_rows = [parts[j] for parts in recv_parts]
        packed = torch.cat([send[send_at[d] + sum(p[:j]):][:p[j]]
                            for d, p in enumerate(send_parts)])
        got = recv.new_empty(sum(in_rows), *recv.shape[1:])
        blocks = [recv[recv_at[s] + sum(p[:j]):][:p[j]] for s, p in enumerate(recv_parts)]
        work = transport_of(None).all_to_all(got, packed, in_rows, out_rows, async_op=True)
        pending.append((work, lambda got=got, blocks=blocks, n=in_rows: [
            b.copy_(g) for b, g in zip(blocks, got.split(n))]))
    return pending

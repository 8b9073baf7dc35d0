"""Collectives on shared memory (:class:`ShmGroup`): all_reduce, all_gather, reduce_scatter and
all_to_all, uneven splits included, for any dtype; every one is a :class:`~.calls.Call`.

=================  ==============================================================
all_reduce         one-shot (each rank writes its tensor into its buffer and reads
                   every peer's, summing in rank order 0, 1, …): at most
                   ``ONE_SHOT_BYTES``. Two-shot above (a reduce-scatter into each
                   rank's own chunk, summed in rank order by that chunk's owner,
                   then an all-gather of the chunks): each rank reads 2 × the
                   message instead of (world − 1) ×. Either way every rank holds
                   the same bits: each element is summed once, in one order.
all_gather         each rank writes its rows into its buffer, reads every peer's.
reduce_scatter     each rank writes its tensor but its own rows, and sums its own rows
                   of every peer's, its own read where they are.
all_to_all         each rank writes its send rows but its own block, which it copies
                   straight to its output; the header carries its splits, so a
                   receiver finds its rows in the sender's buffer.
=================  ==============================================================

A message larger than ``TURN_BYTES`` (or a buffer) goes in turns of at most that many bytes,
one call a turn: its stages stay in the cores' caches, and no message is too big for a
buffer. all_reduce cuts the tensor; all_gather each rank's rows; reduce_scatter every rank's
rows of the tensor; all_to_all every block (sender, receiver), once a first call's headers
have given every rank every split. A turn's staging is at most ``turn_bytes`` plus one
element a rank (the rounding of its ranges), which the buffer always holds.

A group is used by one thread (the first to call it; another is refused). A call that
raises on one rank after the group's calls began there, other than a refusal every rank
reaches alike, is a failure: that rank raises its ``FAILED`` word with what it raised, its
peers raise :class:`~.shm.PeerFailed` instead of reading what it left, and every later
call on the group, on every rank, raises :class:`GroupBroken`: make a new group.
"""

from __future__ import annotations

import math
import threading
from typing import Sequence

import torch
import torch.distributed as dist

from ..perf.pieces import offsets
from .base import Done, Transport, sum_in_rank_order as _sum_into
from .calls import DTYPE_CODES, Call, Carried, Header
from .shm import ShmSegments

__all__ = ["ShmGroup", "ShmTransport", "GroupBroken", "ONE_SHOT_BYTES", "TURN_BYTES",
           "default_capacity", "chunk_bounds"]

ONE_SHOT_BYTES = 256 * 1024
# A larger all-reduce goes in turns of this many bytes, one call each: a turn's staged
# chunks, sums and copies stay in the cores' caches (1 MiB of L2 a core here) while the
# peer reads them, where one call over the whole message streams every stage through
# memory. 16 MiB on 2 ranks of this machine: 3.26 ms in one call, 1.6-1.8 ms in turns of
# 0.75-2 MiB (busbw 39 % of one core's copy, against 74-81 %).
TURN_BYTES = 1 << 20
_SLACK = 16  # bytes a rank a turn may stage past turn_bytes (one element of its range)
_AR_NAMES = ("dtype", "numel")


class GroupBroken(RuntimeError):
    """A call on a group whose earlier call failed (here or on a peer): make a new group."""


def default_capacity(world: int) -> int:
    """Bytes of a data buffer by default: a turn and its rounding (no call stages more), to
    a page."""
    return -(-(TURN_BYTES + _SLACK * world) // 4096) * 4096


class ShmGroup:
    """The collectives of ``group``'s ranks over their shared memory (collective to make:
    every rank of the group). ``capacity``: bytes of one data buffer of a segment (every
    rank the same; default :func:`default_capacity`). Raises
    :class:`~.shm.ShmUnavailable` on every rank where the ranks cannot share memory."""

    def __init__(self, group=None, *, capacity: int | None = None, timeout_s: float = 60.0):
        import torch.distributed as dist

        world = dist.get_world_size(group)
        capacity = default_capacity(world) if capacity is None else int(capacity)
        if capacity < 4096 + _SLACK * world:
            raise ValueError(f"shared memory: a buffer of {capacity} bytes is too small for "
                             f"{world} ranks; give at least {4096 + _SLACK * world}")
        self.group = group
        self.segments = ShmSegments(group, capacity=capacity, timeout_s=timeout_s)
        self.rank, self.world = self.segments.rank, self.segments.world
        self.capacity = capacity
        self.header_words = self.segments.layout.header_words  # a call's header holds these
        # the most one call stages a rank, besides the rounding of its ranges (_SLACK)
        self.turn_bytes = min(capacity - _SLACK * world, TURN_BYTES)
        self.epoch = 0
        self._call: Call | None = None  # the latest call begun
        self._owner: int | None = None  # the thread that makes this group's calls
        self._broken: str | None = None  # why this group's calls stopped
        self._ticks, self._tick_at = self.segments.ticks, self.segments.tick_at
        self._reduce_headers: dict[tuple, Header] = {}  # a plain all_reduce's, by dtype, numel
        self._gather_names = ("dtype", "width", *(f"rows{r}" for r in range(self.world)),
                              "piece")

    def call(self, op: str, names: Sequence[str], values: Sequence[int], *,
             local: Sequence[str] = (), problem: Exception | None = None) -> Call:
        """Begin the group's next call (every rank, in the same order)."""
        return self.begin(Header(op, names, values, local), problem)

    def begin(self, header: Header, problem: Exception | None = None) -> Call:
        """Begin the group's next call with a ``header`` made already (every rank, in the
        same order)."""
        self.epoch += 1
        if self._ticks is not None:  # the watchdog's board: this rank made a call
            self._ticks[self._tick_at] += 1
        call = self._call = Call(self.segments, self.epoch, header, problem)
        return call

    # --- who may call, and what a failure does ----------------------------------------
    def _enter(self) -> None:
        """Refuse a call on a broken group, or from a thread other than the group's own."""
        if self._broken is not None:
            raise GroupBroken(f"shared memory: this group's calls stopped: {self._broken}; "
                              f"make a new group")
        thread = threading.get_ident()
        if thread != self._owner:
            if self._owner is not None:
                raise RuntimeError(f"shared memory: a ShmGroup is used by one thread; thread "
                                   f"{thread} called one that thread {self._owner} uses")
            self._owner = thread

    def _failed(self, err: BaseException) -> None:
        """``err`` left a call on this rank: unless it is a refusal every rank reached alike
        (the call closed, the group goes on), the group stops, and the peers are told."""
        call = self._call
        if self._broken is not None or (call is not None and call.refused
                                        and call.epoch == self.epoch):
            return
        op = call.header.op if call is not None and call.epoch == self.epoch else "a call"
        self._broken = (f"rank {self.rank}'s call {self.epoch} ({op}) raised "
                        f"{type(err).__name__}: {err}")
        self.segments.fail(self._broken)

    def gather_meta(self, op: str, row: Sequence[int] | None, width: int,
                    problem: Exception | None = None, verify=None) -> list[tuple[int, ...]]:
        """Every rank's ``row`` (raising on every rank where any rank had a ``problem``):
        the operators' cross-rank check, carried by one call's header. ``verify``: the
        operator's check of the rows, asked for its error where a peer made the same
        operation with another header (:meth:`~.calls.Call.exchange`)."""
        self._enter()
        try:
            row = tuple(row) if problem is None else (0,) * width
            call = self.call(op, [f"f{i}" for i in range(width)], row,
                             local=[f"f{i}" for i in range(width)], problem=problem)
            rows = call.exchange(verify)
            call.close()
            return rows
        except BaseException as err:
            self._failed(err)
            raise

    def barrier(self) -> None:
        self._enter()
        try:
            call = self.call("barrier", (), ())
            call.exchange()
            call.close()
        except BaseException as err:
            self._failed(err)
            raise

    # --- all_reduce ------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, check: Carried | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place (contiguous); above ``TURN_BYTES`` in
        turns of at most that many bytes, one call each (see ``TURN_BYTES``). ``check``:
        an operator's fields, carried in the call's header (in turns: in a call of its own
        first)."""
        self._enter()
        try:
            flat = tensor.view(-1)
            size = flat.numel() * flat.element_size()
            if size <= self.turn_bytes:
                self._all_reduce(flat, size, check=check)
                return tensor
            self._check_alone(check)  # in turns: the check goes first, in a call of its own
            per_turn = max(self.world,
                           self.turn_bytes // tensor.element_size() // self.world * self.world)
            for lo in range(0, flat.numel(), per_turn):
                part = flat[lo:lo + per_turn]
                self._all_reduce(part, part.numel() * part.element_size())
            return tensor
        except BaseException as err:
            self._failed(err)
            raise

    def reduce_computed(self, compute, out: torch.Tensor, check: Carried | None = None
                        ) -> torch.Tensor:
        """``out`` = the sum over ranks of ``compute(slot)``, where ``compute`` writes this
        rank's term straight into its slot (``torch.mm(x, w, out=slot)``): the term is made
        where its peers read it, with no copy into a buffer. ``out`` contiguous, within one
        buffer. ``check``: the operator's fields, carried in the call's header;
        ``check.verify(rows)`` (every rank's values) raises where they do not agree, on
        every rank alike."""
        self._enter()
        try:
            flat = out.view(-1)
            size = flat.numel() * flat.element_size()
            assert size <= self.capacity, (size, self.capacity)
            self._all_reduce(flat, size, compute, check)
            return out
        except BaseException as err:
            self._failed(err)
            raise

    def reduce_into(self, fill, dtype: torch.dtype, shape: tuple, check: Carried | None = None
                    ) -> torch.Tensor:
        """The sum over ranks of what ``fill(out)`` writes into this rank's slot, viewed as
        ``shape`` (at most ``ONE_SHOT_BYTES``; ``torch.mm(x, w, out=out)``), in one call:
        ``reduce_computed``'s one-shot path with nothing between the operator and its call
        (a decoding step makes a few dozen a token). The sum: a new tensor, in rank order."""
        self._enter()
        try:
            call, slots = self._open(dtype, math.prod(shape), check)
            fill(slots[self.rank].view(shape))
            return self._sum_new(call, slots, check, shape)
        except BaseException as err:
            self._failed(err)
            raise

    def summed(self, tensor: torch.Tensor, check: Carried | None = None) -> torch.Tensor:
        """The sum of ``tensor`` (at most ``ONE_SHOT_BYTES``) over the group, as a new
        tensor, ``tensor`` untouched: an all_reduce without the copy a caller makes to keep
        its input (an embedding's lookup, a decoding step's). In rank order, one call."""
        self._enter()
        try:
            call, slots = self._open(tensor.dtype, tensor.numel(), check)
            slots[self.rank].copy_(tensor.detach().reshape(-1))  # the slot is no autograd input
            return self._sum_new(call, slots, check, tensor.shape)
        except BaseException as err:
            self._failed(err)
            raise

    def _open(self, dtype: torch.dtype, count: int, check: Carried | None):
        """An all_reduce's call begun (``check`` in its header, before the call's own
        numel) and every rank's slot of ``count`` elements, for this rank to write its
        term into."""
        header = self._plain_header(dtype, count) if check is None else \
            check.header(("numel",), (count,))
        call = self.begin(header)
        return call, call.slots(dtype, count)

    def _sum_new(self, call: Call, slots: list[torch.Tensor], check: Carried | None,
                 shape: Sequence[int]) -> torch.Tensor:
        """Once this rank's term is in its slot: every rank's summed in rank order into a
        new tensor of ``shape`` (the operator's check judged first), the call closed. The
        tensor is no view (a caller may change it in place under autograd)."""
        _exchange(call, check)  # every rank's term is in its slot
        out = slots[0].new_empty(shape)
        _sum_into(out.view(-1), slots)
        call.close()
        return out

    def _plain_header(self, dtype: torch.dtype, n: int) -> Header:
        """A plain all_reduce's header (kept, by dtype and numel)."""
        header = self._reduce_headers.get((dtype, n))
        if header is None:
            if len(self._reduce_headers) > 1024:
                self._reduce_headers.clear()
            header = self._reduce_headers[dtype, n] = Header("all_reduce", _AR_NAMES,
                                                             (DTYPE_CODES[dtype], n))
        return header

    def _all_reduce(self, flat: torch.Tensor, size: int, compute=None,
                    check: Carried | None = None) -> None:
        n, dtype = flat.numel(), flat.dtype
        call, slots = self._open(dtype, n, check)
        slot = slots[self.rank]
        two_shot = size > ONE_SHOT_BYTES
        bounds = chunk_bounds(n, self.world) if two_shot else None
        if compute is not None:
            compute(slot.view(flat.shape if flat.dim() > 1 else (-1,)))
        elif two_shot:  # the peers read every chunk but this rank's own: stage only those
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            slot[:lo].copy_(flat[:lo])
            slot[hi:].copy_(flat[hi:])
        else:
            slot.copy_(flat)
        _exchange(call, check)  # every rank's tensor is in its slot
        if not two_shot:
            _sum_into(flat, slots)
        else:
            lo, hi = bounds[self.rank], bounds[self.rank + 1]
            own = slot[lo:hi]
            # this rank's chunk, summed in rank order straight into its slot (which held
            # nothing the peers read: its own chunk was read from flat, or is overwritten
            # only after every term is read), then copied out
            terms = [own if (r == self.rank and compute is not None) else
                     flat[lo:hi] if r == self.rank else call.slot(r, dtype, n)[lo:hi]
                     for r in range(self.world)]
            if compute is not None and self.world > 2:
                _sum_into(flat[lo:hi], terms)
                own.copy_(flat[lo:hi])
            else:
                _sum_into(own, terms)
                flat[lo:hi].copy_(own)
            call.reduced()
            for rank in range(self.world):
                if rank != self.rank:
                    a, b = bounds[rank], bounds[rank + 1]
                    call.wait_reduced(rank)
                    flat[a:b].copy_(call.slot(rank, flat.dtype, n)[a:b])
        call.close()

    # --- all_gather, reduce_scatter, all_to_all ---------------------------------------
    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int],
                   check: Carried | None = None) -> torch.Tensor:
        """Every rank's ``piece`` ([rows[r], ...]) concatenated in rank order into ``out``.
        ``check``: an operator's fields, carried in the call's header and judged by its
        ``verify`` before the gather's own fields are. Where the largest piece is over
        ``TURN_BYTES`` (or a buffer), in turns: each rank's piece cut into as many element
        ranges, one call a range (every rank knows every piece's size: ``rows``)."""
        self._enter()
        try:
            width = math.prod(piece.shape[1:])  # an empty share has a width too
            counts = [int(r) * width for r in rows]
            turns = self._turns(max(counts, default=0) * piece.element_size())
            if turns > 1:  # in turns: the check first, a call of its own
                self._check_alone(check)
                check = None
            # a rank whose piece is not the rows it is said to hold writes nothing; every rank
            # reads that in its header and refuses alike
            held_wrong = piece.shape[0] != int(rows[self.rank])
            problem = None  # this rank's output, refused on every rank in the call's header
            if not out.is_contiguous() or out.numel() != sum(counts):
                problem = ValueError(f"all_gather: rank {self.rank}'s output is not "
                                     f"{sum(int(r) for r in rows)} contiguous rows of {width}")
            mine, starts = piece.reshape(-1), offsets(counts)
            flat = out.view(-1) if problem is None else None
            names = self._gather_names
            values = (DTYPE_CODES[piece.dtype], width, *rows, piece.shape[0])
            for turn in range(turns):
                parts = [(0, c) for c in counts] if turns == 1 else \
                    [chunk_bounds(c, turns)[turn:turn + 2] for c in counts]
                if check is None:
                    call, ahead = self.call("all_gather", names, values, local=("piece",),
                                            problem=problem), 0
                else:  # every field local: the operator's verdict comes first
                    call = self.begin(check.header(names, values), problem)
                    ahead, names = len(check.names), call.header.names
                a, b = parts[self.rank]
                if not held_wrong and problem is None:
                    call.slot(self.rank, piece.dtype, b - a).copy_(mine if turns == 1 else mine[a:b])
                headers = call.exchange(check and _fields_of(check))
                if ahead and not call.alike:
                    _judge(call, check, [row[:ahead] for row in headers])
                    call.check_fields([row[ahead:] for row in headers], names[ahead:],
                                      ("piece",))
                held = [row[-1] for row in headers]
                if held != list(values[2:-1]):  # the same verdict on every rank: rows agree
                    raise call.refuse(ValueError(f"all_gather: the ranks expect rows "
                                                 f"{list(rows)}, they hold {held}"))
                if turns == 1:  # every piece whole, in rank order: one op
                    torch.cat([call.slot(r, piece.dtype, c) for r, c in enumerate(counts)],
                              out=flat)
                else:
                    for rank, (a, b) in enumerate(parts):
                        at = starts[rank]
                        flat[at + a:at + b].copy_(call.slot(rank, piece.dtype, b - a))
                call.close()
            return out
        except BaseException as err:
            self._failed(err)
            raise

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor,
                       rows: Sequence[int]) -> torch.Tensor:
        """Rows ``rows[r]`` of the sum of every rank's ``tensor`` land on rank r's ``out``.
        Where the tensor is over ``TURN_BYTES`` (or a buffer), in turns: every rank's rows cut
        into as many element ranges, one call a range, each writing that range of every
        rank's rows."""
        self._enter()
        try:
            width = math.prod(tensor.shape[1:])
            counts = [int(r) * width for r in rows]
            segments = offsets(counts)  # where each rank's rows start in the flat tensor
            flat = tensor.reshape(-1)
            mine = out.view(-1) if out.is_contiguous() else None
            turns = self._turns(tensor.numel() * tensor.element_size())
            names = ("dtype", "width", "total", *(f"rows{r}" for r in range(self.world)))
            values = (DTYPE_CODES[tensor.dtype], width, tensor.shape[0], *rows)
            problem = None  # this rank's, refused on every rank in the call's header
            if tensor.shape[0] != sum(int(r) for r in rows):
                problem = ValueError(f"reduce_scatter: rows {list(rows)} sum to "
                                     f"{sum(int(r) for r in rows)}, the tensor has {tensor.shape[0]}")
            elif mine is None or mine.numel() != counts[self.rank]:
                problem = ValueError(f"reduce_scatter: rank {self.rank}'s output is not "
                                     f"{rows[self.rank]} contiguous rows of {width}")
            # in place (out a view of tensor's own rows): each turn reads its own range first
            in_place = problem is None and _shares_memory(
                flat[segments[self.rank]:segments[self.rank + 1]], mine)
            for turn in range(turns):
                parts = [chunk_bounds(c, turns)[turn:turn + 2] for c in counts]
                sizes = [b - a for a, b in parts]
                at = offsets(sizes)  # each rank's range, in turn, in a slot
                call = self.call("reduce_scatter", names, values, problem=problem)
                if call.problem is None:  # the peers read every range but this rank's own
                    slot = call.slot(self.rank, tensor.dtype, at[-1])
                    for rank, (a, b) in enumerate(parts):
                        if rank != self.rank:
                            slot[at[rank]:at[rank + 1]].copy_(flat[segments[rank] + a:
                                                                   segments[rank] + b])
                call.exchange()
                a, b = parts[self.rank]
                own = flat[segments[self.rank] + a:segments[self.rank] + b]
                if in_place:
                    own = own.clone()
                _sum_into(mine[a:b], [own if r == self.rank else
                                      call.slot(r, tensor.dtype, at[-1])[at[self.rank]:
                                                                         at[self.rank + 1]]
                                      for r in range(self.world)])
                call.close()
            return out
        except BaseException as err:
            self._failed(err)
            raise

    def all_to_all(self, out: torch.Tensor, send: torch.Tensor, out_rows: Sequence[int],
                   in_rows: Sequence[int]) -> torch.Tensor:
        """Rows ``in_rows[d]`` of ``send`` go to rank d; rows from rank s land in order.

        One call where every rank's send fits a turn (``TURN_BYTES``, and a buffer): the
        header carries each sender's splits, so a receiver finds its rows. Where some rank's
        does not, that call's headers give every rank every split, and the rows then go in
        turns: each block (sender, receiver) cut into as many element ranges, one call a
        range."""
        self._enter()
        try:
            width = math.prod(send.shape[1:])  # a rank that sends and gets no rows too
            world, itemsize = self.world, send.element_size()
            names = ("dtype", "width", *(f"to{d}" for d in range(world)),
                     *(f"from{s}" for s in range(world)), "whole")
            whole = send.numel() * itemsize <= self.turn_bytes
            mine = send.reshape(-1)
            if _shares_memory(out, send):  # in place: this rank's own block lands before the
                mine = mine.clone()        # blocks after it are read
            sends = offsets([int(n) * width for n in in_rows])  # each receiver's block in send
            problem = None
            if not out.is_contiguous():
                problem = ValueError(f"all_to_all: rank {self.rank}'s output is not contiguous")
            elif sends[-1] != mine.numel() or sum(int(n) for n in out_rows) * width != out.numel():
                problem = ValueError(f"all_to_all: rank {self.rank} sends {list(in_rows)} rows "
                                     f"from {send.shape[0]} and receives {list(out_rows)} into "
                                     f"{out.shape[0] if out.dim() else 0}")
            flat = out.view(-1) if problem is None else None
            call = self.call("all_to_all", names, (DTYPE_CODES[send.dtype], width, *in_rows, *out_rows,
                                                   int(whole)), local=names[2:], problem=problem)
            if whole and problem is None:  # every block but this rank's own, where its receiver
                lo, hi = sends[self.rank], sends[self.rank + 1]  # finds it
                slot = call.slot(self.rank, send.dtype, send.numel())
                slot[:lo].copy_(mine[:lo])
                slot[hi:].copy_(mine[hi:])
            rows = call.exchange()
            sent = [row[2:2 + world] for row in rows]        # [sender][receiver]
            expected = [row[2 + world:2 + 2 * world] for row in rows]  # [receiver][sender]
            wrong = [(s, r) for s in range(world) for r in range(world)
                     if sent[s][r] != expected[r][s]]
            if wrong:  # every rank sees every header: the same verdict everywhere
                s, r = wrong[0]
                raise call.refuse(ValueError(f"all_to_all: rank {s} sends rank {r} "
                                             f"{sent[s][r]} rows, rank {r} expects "
                                             f"{expected[r][s]}"))
            if all(row[-1] for row in rows):  # every send in this call
                start = 0
                for rank in range(world):
                    count = sent[rank][self.rank] * width
                    offset = sum(sent[rank][:self.rank]) * width
                    flat[start:start + count].copy_(
                        mine[offset:offset + count] if rank == self.rank else
                        call.slot(rank, send.dtype, count, offset * itemsize))
                    start += count
                call.close()
                return out
            call.close()
            counts = [[n * width for n in row] for row in sent]  # [sender][receiver] elements
            turns = self._turns(max(sum(row) for row in counts) * itemsize)
            lands = offsets([counts[s][self.rank] for s in range(world)])  # each sender's in out
            for turn in range(turns):
                parts = [[chunk_bounds(n, turns)[turn:turn + 2] for n in row] for row in counts]
                call = self.call("all_to_all", ("dtype", "width", "turn"),
                                 (DTYPE_CODES[send.dtype], width, turn))
                at = offsets([b - a for a, b in parts[self.rank]])
                slot = call.slot(self.rank, send.dtype, at[-1])
                for d, (a, b) in enumerate(parts[self.rank]):
                    if d != self.rank:  # this rank's own block goes straight to out, below
                        slot[at[d]:at[d + 1]].copy_(mine[sends[d] + a:sends[d] + b])
                call.exchange()
                for s in range(world):
                    (a, b), before = parts[s][self.rank], parts[s][:self.rank]
                    offset = sum(y - x for x, y in before) * itemsize
                    flat[lands[s] + a:lands[s] + b].copy_(
                        mine[sends[s] + a:sends[s] + b] if s == self.rank else
                        call.slot(s, send.dtype, b - a, offset))
                call.close()
            return out
        except BaseException as err:
            self._failed(err)
            raise

    def _turns(self, nbytes: int) -> int:
        """Calls a message of ``nbytes`` (the largest one rank writes) takes: one up to
        ``TURN_BYTES`` (and a buffer), then one a turn (every rank counts alike)."""
        return max(1, -(-int(nbytes) // self.turn_bytes))

    def _check_alone(self, check: Carried | None) -> None:
        """An operator's check in a header-only call of its own, judged by its ``verify`` on
        every rank alike: for data that goes in turns."""
        if check is not None:
            rows = self.gather_meta(check.op, check.values, len(check.values))
            _judge(self._call, check, rows)


def _exchange(call: Call, check: Carried | None) -> None:
    """An all_reduce's headers exchanged, and the operator's ``check`` judged on every
    rank's fields (its own numel last) where the headers differ: the same rows, the same
    verdict, on every rank; the call closed where it refuses."""
    rows = call.exchange(check and _fields_of(check))
    if check is not None and not call.alike:  # one header everywhere: nothing differs
        _judge(call, check, [row[:-1] for row in rows])


def _fields_of(check: Carried):
    """``check.verify`` on the check's own fields of a row that may hold more."""
    ahead = len(check.names)
    return lambda rows: check.verify([row[:ahead] for row in rows])


def _judge(call: Call, check: Carried, rows: list[tuple[int, ...]]) -> None:
    """``check.verify(rows)``: every rank judges the same rows alike, so a verdict against
    them is a refusal (the call closed; the group goes on)."""
    try:
        check.verify(rows)
    except (ValueError, TypeError) as err:
        raise call.refuse(err) from None


def chunk_bounds(n: int, world: int) -> list[int]:
    """The chunk boundaries of ``n`` elements over ``world`` owners (the first get one more)."""
    base, extra = divmod(n, world)
    out = [0]
    for r in range(world):
        out.append(out[-1] + base + (r < extra))
    return out


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes ``a`` and ``b`` span overlap (a collective called in place reads
    its input where it writes its output). By address, not by storage: two tensors made
    over one buffer (``torch.from_numpy`` of two views, two maps of one file) are
    different storages over the same bytes."""
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses from ``t``'s first element to just past its last (an empty one: none)."""
    if t.numel() == 0:
        return 0, 0
    last = sum((n - 1) * abs(step) for n, step in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


class ShmTransport(Transport):
    """:class:`ShmGroup` as a :class:`~.base.Transport` (what the operators call, the same
    calls as ``torch.distributed``'s): it lends its slots, carries checks in its headers,
    and its own core moves the bytes."""

    lends_slots = True
    carries_checks = True
    pieces_overlap = False

    def __init__(self, group, choice, *, timeout_s: float):
        super().__init__(group, choice, one_host=True)
        self.shm = ShmGroup(group, timeout_s=timeout_s)  # ShmUnavailable: every rank alike
        self.header_words = self.shm.header_words
        self._one_shot = ONE_SHOT_BYTES  # a product or sum up to this size: one call

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, check=None):
        """``check``: an operator's cross-rank check (:class:`~.calls.Carried`), carried in
        the header of the call that moves the data."""
        if tensor.is_contiguous():
            self.shm.all_reduce(tensor, check=check)
        else:
            tensor.copy_(self.shm.all_reduce(tensor.contiguous(), check=check))
        return Done() if async_op else None

    def summed(self, tensor: torch.Tensor, check=None) -> torch.Tensor:
        """The sum of ``tensor`` over the group as a new tensor (``tensor`` untouched);
        ``check`` as ``all_reduce``'s. One-shot sizes: no copy of the input first."""
        if tensor.numel() * tensor.element_size() <= self._one_shot:
            return self.shm.summed(tensor, check=check)
        out = tensor.contiguous().clone()
        self.shm.all_reduce(out, check=check)
        return out

    def reduce_computed(self, fill, shape, like: torch.Tensor, check=None) -> torch.Tensor:
        """The sum of ``fill(out)``'s terms with each rank's term written straight into its
        slot (where the peers read it): one copy less than computing, then reducing. Up to
        one-shot size: one call (``ShmGroup.reduce_into``); up to a turn
        (``ShmGroup.turn_bytes``): in the slot (``ShmGroup.reduce_computed``); over a turn:
        computed, then reduced in turns, the check in a call of its own first (each turn's
        stages in cache: a 4 MiB product reduced in its slot ran 5 % slower)."""
        shape = tuple(shape)
        size = math.prod(shape) * like.element_size()
        if size <= self._one_shot:
            return self.shm.reduce_into(fill, like.dtype, shape, check=check)
        held = like.new_empty(shape)  # reduced in place
        if size > self.shm.turn_bytes:
            fill(held)
            self.shm.all_reduce(held, check=check)
        else:
            self.shm.reduce_computed(lambda slot: fill(slot.view(shape)), held, check=check)
        return held

    def gather_meta(self, op: str, row, width: int, problem, verify):
        return self.shm.gather_meta(op, row, width, problem, verify)

    def all_gather(self, out, piece, rows, async_op: bool = False, check=None):
        self.shm.all_gather(out, piece.contiguous(), rows, check=check)
        return Done() if async_op else None

    def all_to_all(self, out, send, out_rows, in_rows, async_op: bool = False):
        self.shm.all_to_all(out, send.contiguous(), out_rows, in_rows)
        return Done() if async_op else None

    def reduce_scatter(self, out, tensor, rows, async_op: bool = False):
        self.shm.reduce_scatter(out, tensor.contiguous(), rows)
        return Done() if async_op else None

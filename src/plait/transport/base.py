"""What every transport is made of: the contract :mod:`plait.ops` calls (:class:`Transport`),
the choice and its reason, a call's finished handle, and the transport over
``torch.distributed`` itself (gloo on CPU, NCCL on CUDA), which the others fall back on for
what they do not carry."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_into

__all__ = ["Choice", "DistTransport", "Done", "EXCHANGE_BYTES", "Transport", "dist_all_gather",
           "dist_all_reduce", "latency_bound", "sum_in_rank_order"]

# Up to this many bytes, gloo's all-reduce is an exchange (below). Measured on 2 cores (AMD
# EPYC, torch 2.13, gloo over loopback, float32, 2 and 3 ranks, mean µs a call): the exchange
# against dist.all_reduce: 2 KiB 362 vs 1652 (2 ranks), 1026 vs 3134 (3 ranks); 64 KiB 289 vs
# 638, 963 vs 3217; 1 MiB 505 vs 913, 2452 vs 2742; 4 MiB 3719 vs 2717, 8565 vs 4207 (the
# ring's fewer bytes a link win there).
EXCHANGE_BYTES = 256 * 1024


@dataclass(frozen=True)
class Choice:
    name: str    # "shm", "gloo" or "nccl"
    reason: str


class Done:
    """A handle of a call already complete."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class Transport:
    """What :mod:`plait.ops` asks of a transport: the collectives on ``group`` and what they
    can do beyond moving bytes, as attributes ops reads instead of a transport's name.

    - ``lends_slots``: ``reduce_computed`` gives ``fill`` the buffer the peers read (shared
      memory), so a product is made where it is summed, one copy less; elsewhere ``fill``
      writes a new tensor that is then all-reduced.
    - ``carries_checks``: an operator's cross-rank check (:class:`~.calls.Carried`) rides in
      the header of the call that moves its data (``check=``), and ``gather_meta`` carries
      a check of its own of up to ``header_words`` words; elsewhere the checks are gathered
      on a sibling group before the data moves, and ``check`` is always None.
    - ``pieces_overlap``: a piece's transfer can run beside the next piece's compute (a
      NIC, a copy engine, gloo's own threads); False where the rank's own core moves the
      bytes (shared memory), so ``chunks="auto"`` takes the plain path.
    - ``one_host``: every rank of the group runs on one host.

    Every call is collective (every rank of the group makes it, in the same order); with
    ``async_op`` it returns a handle with ``wait()``, else None."""

    lends_slots = False
    carries_checks = False
    pieces_overlap = True
    header_words = 0

    def __init__(self, group, choice: Choice, *, one_host: bool = False):
        self.group, self.choice = group, choice
        self.name = choice.name
        self.one_host = one_host

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, check=None):
        """``tensor`` = its sum over the group, in place."""
        raise NotImplementedError

    def summed(self, tensor: torch.Tensor, check=None) -> torch.Tensor:
        """The sum of ``tensor`` over the group as a new tensor (``tensor`` untouched)."""
        out = tensor.contiguous().clone()
        self.all_reduce(out, check=check)
        return out

    def reduce_computed(self, fill, shape: Sequence[int], like: torch.Tensor,
                        check=None) -> torch.Tensor:
        """The sum over the group of what ``fill(out)`` writes into a contiguous ``shape``
        tensor of ``like``'s dtype and device (``torch.mm(x, w, out=out)``): a new tensor."""
        out = like.new_empty(tuple(shape))
        fill(out)
        self.all_reduce(out, check=check)
        return out

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int],
                   async_op: bool = False, check=None):
        """``out`` = every rank's ``piece`` (``rows[r]`` rows from rank r) in rank order."""
        raise NotImplementedError

    def all_to_all(self, out: torch.Tensor, send: torch.Tensor, out_rows: Sequence[int],
                   in_rows: Sequence[int], async_op: bool = False):
        """``send``'s ``in_rows[d]`` rows to rank d; ``out`` their ``out_rows[s]`` from s."""
        raise NotImplementedError

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, rows: Sequence[int],
                       async_op: bool = False):
        """``out`` = this rank's ``rows[rank]`` rows of ``tensor`` summed over the group."""
        raise NotImplementedError

    def gather_meta(self, op: str, row, width: int, problem, verify):
        """Every rank's check ``row`` in a call of its own (``carries_checks`` only)."""
        raise NotImplementedError(f"{self.name} carries no checks")

    def _uncarried(self, check) -> None:
        if check is not None:
            raise ValueError(f"{self.name} carries no check in a data call: the operator "
                             "gathers it first (Transport.carries_checks)")


def sum_in_rank_order(out: torch.Tensor, parts) -> None:
    """``out = parts[0] + parts[1] + …``, in that order (the same bits on every rank)."""
    torch.add(parts[0], parts[1], out=out) if len(parts) > 1 else out.copy_(parts[0])
    for part in parts[2:]:
        out.add_(part)


class _Exchange:
    """A piece sent to every peer of ``group`` and theirs received into ``parts`` (one row a
    rank, this rank's already in place), in flight; ``wait()`` ends it, then calls
    ``finish``."""

    def __init__(self, piece: torch.Tensor, parts: torch.Tensor, group, finish=None):
        rank = dist.get_rank(group)
        peers = [p for p in range(parts.shape[0]) if p != rank]
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)  # global ranks
        self.sends = [dist.isend(piece, ranks[p], group=group) for p in peers]
        self.recvs = [dist.irecv(parts[p], ranks[p], group=group) for p in peers]
        self.finish, self.done = finish, False

    def wait(self, *args, **kwargs) -> bool:
        if not self.done:
            for handle in self.recvs + self.sends:  # the piece is read until its sends end
                handle.wait()
            if self.finish is not None:
                self.finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


_LATENCY_BOUND: ContextVar = ContextVar("plait_latency_bound", default=False)


@contextlib.contextmanager
def latency_bound() -> Iterator[None]:
    """Inside, every rank waits for each small call at once with nothing else to do (a
    decoding step): gloo's are exchanges there (:func:`dist_all_reduce`)."""
    token = _LATENCY_BOUND.set(True)
    try:
        yield
    finally:
        _LATENCY_BOUND.reset(token)


def _exchanges(group, tensor: torch.Tensor) -> bool:
    """Whether a collective of ``tensor`` on ``group`` is an exchange (:func:`dist_all_reduce`):
    the same answer on every rank (what a decoding step is in, the call's size and layout:
    never how this rank calls it, which a slowed rank's timed path changes)."""
    return _LATENCY_BOUND.get() and tensor.device.type == "cpu" and tensor.is_contiguous() \
        and tensor.numel() * tensor.element_size() <= EXCHANGE_BYTES \
        and dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"


def _ended(exchange: _Exchange, async_op: bool):
    if async_op:
        return exchange
    exchange.wait()
    return None


def dist_all_reduce(tensor: torch.Tensor, group, async_op: bool = False):
    """``dist.all_reduce(tensor, group=group)``; on gloo, the same sum in every rank's bits.

    Inside :func:`latency_bound` (a decoding step), up to :data:`EXCHANGE_BYTES` of a
    contiguous CPU tensor on gloo, every rank sends the tensor to every other
    (``isend``/``irecv``) and sums the world's in rank order. gloo's collectives run
    each call on a worker thread of their own that hands to the link's thread and back: at
    a few KiB that is 3 to 5 × the exchange's time, and their tail tens of times longer.
    But a send waits for its peer to post the receive and for its own link thread to hear
    so, which a rank that computes makes late: in a training step (pieces in flight, checks
    waited for at once) exchanges made the step 13 to 19 % longer over a 1 Gbit/s link, so
    there, and above the size, gloo's own collectives run. Every rank decides alike."""
    if not _exchanges(group, tensor):
        return dist.all_reduce(tensor, group=group, async_op=async_op)
    flat = tensor.detach().view(-1)  # in place, outside autograd, as torch.distributed's
    parts = flat.new_empty(dist.get_world_size(group), flat.numel())
    parts[dist.get_rank(group)].copy_(flat)

    return _ended(_Exchange(parts[dist.get_rank(group)], parts, group,
                            lambda: sum_in_rank_order(flat, parts)), async_op)


def dist_all_gather(out: torch.Tensor, piece: torch.Tensor, group, async_op: bool = False):
    """``out`` = every rank's ``piece`` in rank order (equal pieces): torch.distributed's
    all_gather, or on gloo up to :data:`EXCHANGE_BYTES` an exchange (:func:`dist_all_reduce`)."""
    piece = piece.contiguous()
    if not (_exchanges(group, out) and out.is_contiguous()):
        return all_gather_into(out, piece, group=group, async_op=async_op)
    parts = out.detach().view(dist.get_world_size(group), -1)
    parts[dist.get_rank(group)].copy_(piece.detach().view(-1))
    return _ended(_Exchange(parts[dist.get_rank(group)], parts, group), async_op)


class DistTransport(Transport):
    """``torch.distributed`` on ``group`` (gloo on CPU, NCCL on CUDA). ``one_host``: every
    rank of the group runs on one host (gloo then moves bytes over loopback TCP: copies
    made by the same cores that compute)."""

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, check=None):
        self._uncarried(check)
        return dist_all_reduce(tensor, self.group, async_op)

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int],
                   async_op: bool = False, check=None):
        """Equal rows: one all_gather; unequal (gloo refuses them): one all_to_all whose send
        buffer repeats the piece once per rank."""
        self._uncarried(check)
        if len(set(rows)) == 1:
            return dist_all_gather(out, piece, self.group, async_op)
        world = len(rows)
        send = piece.unsqueeze(0).expand(world, *piece.shape) \
            .reshape(world * piece.shape[0], *piece.shape[1:]).contiguous()
        return self.all_to_all(out, send, list(rows), [piece.shape[0]] * world, async_op)

    def all_to_all(self, out: torch.Tensor, send: torch.Tensor, out_rows: Sequence[int],
                   in_rows: Sequence[int], async_op: bool = False):
        assert out.is_contiguous(), "a receive buffer is written in place"
        return dist.all_to_all_single(out, send.contiguous(), [int(r) for r in out_rows],
                                      [int(r) for r in in_rows], group=self.group,
                                      async_op=async_op)

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, rows: Sequence[int],
                       async_op: bool = False):
        """One all_to_all, then a rank-ordered sum (gloo's reduce_scatter moves as much data
        as an all_reduce); synchronous."""
        rank, world = dist.get_rank(self.group), len(rows)
        mine = rows[rank]
        width = tensor[0].numel() if tensor.shape[0] else out.numel() // max(mine, 1)
        recv = tensor.new_empty(world * mine, width)
        self.all_to_all(recv, tensor.reshape(tensor.shape[0], -1), [mine] * world, list(rows))
        parts = recv.view(world, mine, width)
        flat = out.view(mine, width)
        flat.copy_(parts[0])
        for src in range(1, world):
            flat.add_(parts[src])
        return Done() if async_op else None

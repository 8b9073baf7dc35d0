"""What every transport is made of: the choice and its reason, a call's finished handle, and
the transport over ``torch.distributed`` itself (gloo on CPU, NCCL on CUDA), which the
others fall back on for what they do not carry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_into

__all__ = ["Choice", "DistTransport", "Done"]


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


class DistTransport:
    """``torch.distributed`` on ``group`` (gloo on CPU, NCCL on CUDA). ``one_host``: every
    rank of the group runs on one host (gloo then moves bytes over loopback TCP: copies
    made by the same cores that compute)."""

    def __init__(self, group, choice: Choice, *, one_host: bool = False):
        self.group, self.choice = group, choice
        self.name = choice.name
        self.one_host = one_host

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return dist.all_reduce(tensor, group=self.group, async_op=async_op)

    def summed(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the group as a new tensor (``tensor`` untouched)."""
        out = tensor.contiguous().clone()
        self.all_reduce(out)
        return out

    def all_gather(self, out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int],
                   async_op: bool = False):
        """Equal rows: one all_gather; unequal (gloo refuses them): one all_to_all whose send
        buffer repeats the piece once per rank."""
        if len(set(rows)) == 1:
            return all_gather_into(out, piece.contiguous(), group=self.group, async_op=async_op)
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

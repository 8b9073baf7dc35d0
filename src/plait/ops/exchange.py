"""The transfers a piece makes: gathers and all-to-alls over uneven per-rank row counts.

Each function starts one asynchronous collective and returns its work handle.
On CPU that is gloo's async work; on CUDA, NCCL runs it on its own stream,
which waits for the compute stream up to the moment of the call (so the piece
just computed is complete) and lets the next piece's kernels run alongside;
``work.wait()`` makes the compute stream wait for it in turn. One code path
serves both backends.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_into

__all__ = ["start_gather", "start_all_to_all"]


def start_gather(out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int], group=None):
    """Every rank's ``piece`` ([rows[r], ...]) concatenated in rank order into ``out``.

    Equal rows: one all_gather, straight from ``piece``. Unequal rows (gloo's
    all_gather refuses them): one all_to_all whose send buffer repeats the piece
    once per rank, the only copy, of piece size.
    """
    if len(set(rows)) == 1:
        return all_gather_into(out, piece.contiguous(), group=group, async_op=True)
    world = len(rows)
    send = piece.unsqueeze(0).expand(world, *piece.shape) \
        .reshape(world * piece.shape[0], *piece.shape[1:]).contiguous()
    return start_all_to_all(out, send, list(rows), [piece.shape[0]] * world, group)


def start_all_to_all(out: torch.Tensor, send: torch.Tensor, out_rows: Sequence[int],
                     in_rows: Sequence[int], group=None):
    """Rows ``in_rows[d]`` of ``send`` go to rank d; rows from rank s land in order in ``out``.

    gloo moves contiguous buffers only: a strided ``send`` is copied (the work holds the
    copy until it is done); ``out`` must be contiguous, since it is written in place."""
    assert out.is_contiguous(), "a receive buffer is written in place"
    return dist.all_to_all_single(out, send.contiguous(), [int(r) for r in out_rows],
                                  [int(r) for r in in_rows],
                                  group=group, async_op=True)

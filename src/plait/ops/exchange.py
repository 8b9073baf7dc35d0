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

__all__ = ["start_gather", "start_all_to_all"]


def start_gather(out: torch.Tensor, piece: torch.Tensor, rows: Sequence[int], group=None):
    """Every rank's ``piece`` ([rows[r], ...]) concatenated in rank order into ``out``, on the
    group's transport (``plait.transport``; over torch.distributed, unequal rows, which
    gloo's all_gather refuses, go as one all_to_all of the piece repeated per rank)."""
    from .context import get_context

    return get_context(group).mover().all_gather(out, piece, rows, async_op=True)


def start_all_to_all(out: torch.Tensor, send: torch.Tensor, out_rows: Sequence[int],
                     in_rows: Sequence[int], group=None):
    """Rows ``in_rows[d]`` of ``send`` go to rank d; rows from rank s land in order in ``out``.

    A strided ``send`` is copied (the work holds the copy until it is done); ``out`` must
    be contiguous, since it is written in place."""
    from .context import get_context

    assert out.is_contiguous(), "a receive buffer is written in place"
    return get_context(group).mover().all_to_all(out, send, out_rows, in_rows, async_op=True)

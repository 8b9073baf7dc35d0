"""One operator at one shape on this rank, as ``plait bench ops`` times it."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Case"]


class Case:
    """One operator at one shape on this rank: ``compute``, ``comm(async_op)``, ``run(chunks)``."""

    op = ""
    seed = 1234  # per case class: each draws its own inputs

    def __init__(self, shape: dict, dtype: torch.dtype):
        self.shape, self.dtype = shape, dtype
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.gen = torch.Generator().manual_seed(self.seed + self.rank)

    def randn(self, *size):
        return torch.randn(*size, generator=self.gen, dtype=self.dtype)

    def tolerance(self) -> float:
        return 1e-4

    def beside(self):
        """The compute and the plain path's transfer at once, neither waiting for the other
        (no data dependency): the best any schedule of this operator can do on this machine,
        where the transfer's own CPU work shares the cores with the compute."""
        work = self.comm(async_op=True)
        self.compute()
        work.wait()

    def plain(self):
        """Compute, then the collective (or the collective, then compute): the reference."""
        return self.run(1)

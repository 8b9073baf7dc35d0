"""Collective names that moved between torch releases (the package admits torch ≥ 2.4)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["all_gather_into", "reduce_scatter_into"]

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
# and warns on the old names; older releases only have the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(output, input, group=None, async_op: bool = False):
    """Concatenate every rank's ``input`` (equal sizes) along dim 0 into ``output``."""
    return _all_gather(output, input, group=group, async_op=async_op)


def reduce_scatter_into(output, input, group=None, async_op: bool = False):
    """Sum ``input`` over ranks and keep this rank's dim-0 slice in ``output``."""
    return _reduce_scatter(output, input, group=group, async_op=async_op)

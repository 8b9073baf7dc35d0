"""A group across hosts with several of its ranks on each: shared memory inside a host and
torch.distributed (gloo) between hosts, in the same call.

``all_reduce`` of a tensor of N elements on H hosts of L ranks each:

1. inside each host, an all_reduce on shared memory: every rank of the host holds the
   host's sum (summed in local rank order);
2. between hosts, each local rank i all-reduces only chunk i of it (N/L elements) with
   the ranks of local index i on the other hosts (gloo): each host link carries N/L·2(H−1)/H
   a rank, N·2(H−1)/H a host, as a ring over hosts would;
3. inside each host, the chunks all-gathered on shared memory.

Every rank ends with the same bits: each chunk is summed once between hosts (gloo sums a
chunk once and copies the result) and copied inside them. The other collectives of such a
group go through gloo on the whole group (the reason is kept with the choice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import ShmGroup, _bounds
from .base import Choice, DistTransport, Done

__all__ = ["HierTransport", "host_groups"]


def host_groups(group, hosts: list[str]):
    """(this rank's host group, its cross-host group of the same local index), made by every
    rank of ``group`` (``hosts``: every rank's host id, in group rank order)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    by_host: dict[str, list[int]] = {}
    for global_rank, host in zip(ranks, hosts):
        by_host.setdefault(host, []).append(global_rank)
    me = dist.get_rank()
    local = next(rs for rs in by_host.values() if me in rs)
    index = local.index(me)
    cross = [rs[index] for rs in by_host.values()]
    local_group = dist.new_group(local, use_local_synchronization=True)
    cross_group = dist.new_group(cross, use_local_synchronization=True)
    return local_group, cross_group, len(local)


class HierTransport(DistTransport):
    """Shared memory inside each host, gloo between hosts, for ``all_reduce``; gloo on the
    whole group for the rest (:class:`DistTransport`)."""

    name = "shm+gloo"

    def __init__(self, group, choice: Choice, hosts: list[str], *, timeout_s: float):
        super().__init__(group, choice)
        self.name = "shm+gloo"
        self.local_group, self.cross_group, self.local = host_groups(group, hosts)
        self.index = dist.get_rank(self.local_group)
        self.shm = ShmGroup(self.local_group, timeout_s=timeout_s)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        self.shm.all_reduce(flat)                                       # 1: the host's sum
        bounds = _bounds(flat.numel(), self.local)
        mine = flat[bounds[self.index]:bounds[self.index + 1]]
        dist.all_reduce(mine, group=self.cross_group)                   # 2: chunk i over hosts
        out = torch.empty_like(flat)
        self.shm.all_gather(out, mine, [bounds[i + 1] - bounds[i] for i in range(self.local)])
        if not tensor.is_contiguous() or flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(out.view(tensor.shape))
        else:
            flat.copy_(out)                                             # 3: every chunk
        return Done() if async_op else None

"""A group across hosts with several of its ranks on some: shared memory inside a host and
torch.distributed (gloo) between hosts, in the same call.

``all_reduce`` of a tensor of N elements on H hosts, the smallest holding L ranks (the
*lanes*; hosts may hold different numbers of ranks, a 2 + 1 layout included):

1. inside each host, an all_reduce on shared memory: every rank of the host holds the
   host's sum (summed in local rank order);
2. between hosts, each local rank i < L all-reduces only chunk i of it (N/L elements)
   with the ranks of local index i on the other hosts (gloo): each host link carries
   N/L·2(H−1)/H a lane, as a ring over hosts would; a host's ranks past L wait;
3. inside each host, the chunks all-gathered on shared memory (a rank past L gives none).

Every rank ends with the same bits: each chunk is summed once between hosts (gloo sums a
chunk once and copies the result) and copied inside them. A host whose ranks cannot share
memory (``ShmUnavailable``: a small ``/dev/shm``, two of them) takes gloo inside itself,
and the choice's reason says so. The other collectives of such a group go through gloo on
the whole group (the reason is kept with the choice).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import Choice, DistTransport, Done, dist_all_reduce
from .collectives import ShmGroup, chunk_bounds
from .shm import ShmUnavailable

__all__ = ["HierTransport", "host_groups"]


def host_groups(group, hosts: list[str]):
    """(this rank's host group, its cross-host group of the same local index or None past
    the lanes, this host's rank count, the lanes), made by every rank of ``group``
    (``hosts``: every rank's host id, in group rank order)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    by_host: dict[str, list[int]] = {}
    for global_rank, host in zip(ranks, hosts):
        by_host.setdefault(host, []).append(global_rank)
    me = dist.get_rank()
    local = next(rs for rs in by_host.values() if me in rs)
    index = local.index(me)
    lanes = min(len(rs) for rs in by_host.values())
    local_group = dist.new_group(local, use_local_synchronization=True)
    cross_group = None
    if index < lanes:
        cross = [rs[index] for rs in by_host.values()]
        cross_group = dist.new_group(cross, use_local_synchronization=True)
    return local_group, cross_group, len(local), lanes


class HierTransport(DistTransport):
    """Shared memory inside each host, gloo between hosts, for ``all_reduce``; gloo on the
    whole group for the rest (:class:`DistTransport`)."""

    name = "shm+gloo"

    def __init__(self, group, choice: Choice, hosts: list[str], *, timeout_s: float):
        super().__init__(group, choice)
        self.name = "shm+gloo"
        self.local_group, self.cross_group, self.local, self.lanes = host_groups(group, hosts)
        self.index = dist.get_rank(self.local_group)
        self.inside = None  # one rank on its host: nothing moves inside it
        self.inside_reason = "one rank on this host"
        if self.local > 1:
            try:
                self.inside = ShmGroup(self.local_group, timeout_s=timeout_s)
                self.inside_reason = "shared memory"
            except ShmUnavailable as err:  # every rank of this host alike
                self.inside = DistTransport(self.local_group, Choice("gloo", str(err)))
                self.inside_reason = f"gloo ({err})"

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, check=None):
        self._uncarried(check)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if self.inside is not None:
            self.inside.all_reduce(flat)                                # 1: the host's sum
        bounds = chunk_bounds(flat.numel(), self.lanes)
        i = self.index  # past the lanes: an empty chunk
        mine = flat[bounds[i]:bounds[i + 1]] if i < self.lanes else flat[:0]
        if self.cross_group is not None:
            dist_all_reduce(mine, self.cross_group)                     # 2: chunk i over hosts
        if self.inside is not None:
            out = torch.empty_like(flat)
            rows = [bounds[i + 1] - bounds[i] if i < self.lanes else 0 for i in range(self.local)]
            self.inside.all_gather(out, mine.contiguous(), rows)       # 3: every chunk
            flat.copy_(out)
        if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            tensor.copy_(flat.view(tensor.shape))
        return Done() if async_op else None

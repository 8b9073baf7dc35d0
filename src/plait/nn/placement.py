"""Experts placed anywhere, hot ones replicated: what an expert-parallel layer needs for it.

A placement (``Homes``) says, for each expert, the ranks holding a copy and the share of its
rows each copy takes (``plait.balance.experts.place_experts`` makes one from routed loads
and rank speeds). Rank r holds the experts of ``slots(r)``, in expert order: its local
``w1``/``w2`` are those experts' rows of the full tensors.

- **Which copy a row goes to** is decided by every rank for its own rows, with no round
  trip: the rows routed to expert e, in token order, are cut by the shares (``split``:
  ``floor(n · share)`` each, the first copy taking what rounding leaves). Each rank's
  per-expert counts already cross the group in the layer's count exchange, so every rank
  derives every other rank's cut alike: ``send`` and ``recv`` follow from that one table.
- **A replicated expert trains as one**: each copy's gradient is a partial sum over the rows
  it took; ``sum_replica_grads`` adds the copies' gradients (one all-reduce over the group
  of a buffer holding only replicated experts; zero where a rank holds no copy), so every
  copy takes the same step and stays equal to the others.
- **Moving** (``gather_placed``): the full tensor from any placement (each expert from its
  first copy), then each rank keeps its new slots: parameters, gradients and optimizer
  state alike (``plait.nn.moe.MoE.place``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..plan import ShardPlan
from ..runtime.compat import all_gather_into

__all__ = ["Homes", "PlacedExperts", "gather_placed", "sum_replica_grads", "by_destination",
           "move_experts", "ReplicaGrads", "copy_rows"]


@dataclass(frozen=True)
class Homes:
    """``homes[e]``: expert e's ``(rank, share)`` copies, shares summing to 1, in the order
    its rows are cut; ``world``: the ranks. Every rank holds at least one expert."""

    homes: tuple[tuple[tuple[int, float], ...], ...]
    world: int

    def __post_init__(self) -> None:
        for e, copies in enumerate(self.homes):
            ranks = [r for r, _ in copies]
            if not copies or len(set(ranks)) != len(ranks) or \
                    any(not 0 <= r < self.world for r in ranks):
                raise ValueError(f"expert {e}: copies {list(copies)} must name distinct ranks "
                                 f"of 0..{self.world - 1}")
            if abs(sum(s for _, s in copies) - 1.0) > 1e-9 or any(s < 0 for _, s in copies):
                raise ValueError(f"expert {e}: shares {[s for _, s in copies]} must be ≥ 0 "
                                 "and sum to 1")
        empty = [r for r in range(self.world) if not self.slots(r)]
        if empty:
            raise ValueError(f"ranks {empty} would hold no expert")

    @classmethod
    def of_plan(cls, plan: ShardPlan) -> "Homes":
        """A contiguous plan's placement: each expert on its owner, one copy."""
        owner = [r for r in range(plan.world) for _ in range(plan.sizes[r])]
        return cls(tuple(((r, 1.0),) for r in owner), plan.world)

    @property
    def experts(self) -> int:
        return len(self.homes)

    def slots(self, rank: int) -> list[int]:
        """The experts ``rank`` holds, in expert order (its local w1/w2 rows)."""
        return [e for e, copies in enumerate(self.homes) if any(r == rank for r, _ in copies)]

    def replicated(self) -> list[int]:
        """Experts with more than one copy, in expert order."""
        return [e for e, copies in enumerate(self.homes) if len(copies) > 1]

    def split(self, e: int, rows: int) -> list[int]:
        """Expert e's ``rows`` (one rank's) cut over its copies: ``floor(rows · share)``
        each, the first copy taking the rest."""
        copies = self.homes[e]
        cut = [int(rows * share) for _, share in copies]
        cut[0] += rows - sum(cut)
        return cut

    def send_recv(self, table: Sequence[Sequence[int]], rank: int
                  ) -> tuple[list[list[int]], list[list[int]]]:
        """From every rank's per-expert row counts (``table[r][e]``): this rank's
        ``send[d][i]`` (its rows for rank d's i-th slot) and ``recv[r][i]`` (rank r's rows for
        this rank's i-th slot), as the fused all-to-all operators take them."""
        slots = [self.slots(d) for d in range(self.world)]
        index = [{e: i for i, e in enumerate(s)} for s in slots]
        send = [[0] * len(s) for s in slots]
        for e, copies in enumerate(self.homes):
            for (d, _), n in zip(copies, self.split(e, table[rank][e])):
                send[d][index[d][e]] += n
        recv = [[0] * len(slots[rank]) for _ in range(self.world)]
        for r in range(self.world):
            for e in slots[rank]:
                j = [d for d, _ in self.homes[e]].index(rank)
                recv[r][index[rank][e]] = self.split(e, table[r][e])[j]
        return send, recv

    def destinations(self, counts: Sequence[int]) -> tuple[list[int], list[int]]:
        """For this rank's rows sorted by expert (``counts[e]`` of each): each block's
        destination rank and length, in expert order then copy order (a row's destination
        is its block's)."""
        dest, sizes = [], []
        for e, copies in enumerate(self.homes):
            for (d, _), n in zip(copies, self.split(e, counts[e])):
                dest.append(d)
                sizes.append(n)
        return dest, sizes


class PlacedExperts:
    """An expert-parallel layer whose experts can be placed anywhere (``plait.nn.MoE``,
    ``plait.parallel.experts.ExpertParallelExperts``); the balancer and serving find such
    layers by this class. The layer sets ``plan`` (its experts' ShardPlan), ``info``,
    ``group``, ``num_experts`` and ``routed`` (a ``RoutedLoad``), and calls ``_placeable``
    with its expert parameters once they exist; this class keeps ``homes`` and answers
    ``place``, the whole tensors and the all-to-alls' counts alike for both."""

    homes: Homes
    placed: bool  # homes is not the plan's: the count table and whole tensors follow homes

    def _placeable(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._expert_params = tuple(params)
        self.homes, self.placed = Homes.of_plan(self.plan), False
        for p in params:  # a replicated expert's copies sum their gradients
            p.register_hook(ReplicaGrads(self))

    def place(self, homes: Homes, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Move the experts to ``homes`` (a collective: every rank, the same homes): each
        rank keeps its new slots of the weights, their gradients and every optimizer state
        tensor of their shape (Adam's moments), gathered whole from the old placement. The
        parameters stay the same objects (the optimizer and hooks keep them). Returns the
        copies placed on a rank that held none of their expert."""
        if homes.world != self.info.world or homes.experts != self.num_experts:
            raise ValueError(f"a placement of {homes.experts} experts on {homes.world} ranks "
                             f"does not fit this layer's {self.num_experts} on "
                             f"{self.info.world}")
        moved = move_experts(self._expert_params, self.homes, homes, self.info.rank,
                             self.group, optimizer)
        self.homes, self.placed = homes, homes != Homes.of_plan(self.plan)
        return moved

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        """The full [E, ...] tensor of this rank's experts' rows (a collective)."""
        if self.placed:
            return gather_placed(local, self.homes, self.group)
        from ._shard import unshard

        return unshard(local, self.plan, self.group, 0)

    def _send_recv(self, table: Sequence[Sequence[int]]) -> tuple[list, list]:
        """The all-to-alls' (send [W][E_d], recv [W][E_r]) from every rank's per-expert
        counts (``table[r][e]``), by the placement or the plan's contiguous blocks."""
        rank = self.info.rank
        if self.placed:
            return self.homes.send_recv(table, rank)
        cuts = [self.plan.slice_of(r) for r in range(self.info.world)]
        return [table[rank][c] for c in cuts], [row[cuts[rank]] for row in table]

    def _where(self) -> str:
        """Where the experts are, for ``extra_repr``."""
        return (f"placed={[self.homes.slots(r) for r in range(self.info.world)]}"
                if self.placed else f"plan={list(self.plan.sizes)} experts")


def gather_placed(local: torch.Tensor, homes: Homes, group) -> torch.Tensor:
    """The full [E, ...] tensor from each rank's slots of it (a collective): each expert
    from its first copy. ``local``: [len(slots(rank)), ...]."""
    counts = [len(homes.slots(r)) for r in range(homes.world)]
    pad = max(counts)
    mine = local.new_zeros((pad, *local.shape[1:]))
    mine[:local.shape[0]] = local
    every = local.new_empty((homes.world * pad, *local.shape[1:]))
    all_gather_into(every, mine.contiguous(), group=group)
    every = every.view(homes.world, pad, *local.shape[1:])
    rows = []
    for e, copies in enumerate(homes.homes):
        r = copies[0][0]
        rows.append(every[r, homes.slots(r).index(e)])
    return torch.stack(rows)


def sum_replica_grads(grad: torch.Tensor, homes: Homes, rank: int, all_reduce) -> torch.Tensor:
    """``grad`` (this rank's slots) with each replicated expert's rows replaced by the sum of
    every copy's (``all_reduce(buffer)`` sums a [R, ...] buffer in place over the group);
    unchanged where no expert is replicated (then no collective, on every rank alike)."""
    replicated = homes.replicated()
    if not replicated:
        return grad
    slots = homes.slots(rank)
    buffer = grad.new_zeros((len(replicated), *grad.shape[1:]))
    for i, e in enumerate(replicated):
        if e in slots:
            buffer[i] = grad[slots.index(e)]
    all_reduce(buffer)
    out = grad.clone()
    for i, e in enumerate(replicated):
        if e in slots:
            out[slots.index(e)] = buffer[i]
    return out


def by_destination(order: torch.Tensor, flat: torch.Tensor, counts: Sequence[int],
                   homes: Homes) -> torch.Tensor:
    """``order`` (this rank's rows sorted by expert, ``counts[e]`` of each) re-sorted by
    destination rank, then expert: each copy's block of an expert's rows goes to its rank,
    and each rank receives its slots' rows in slot order, as the all-to-alls send them."""
    dest, sizes = homes.destinations(counts)
    device = flat.device
    key = torch.tensor(dest, device=device).repeat_interleave(
        torch.tensor(sizes, device=device)) * homes.experts + flat[order]
    return order[torch.argsort(key, stable=True)]


def copy_rows(rows: torch.Tensor, e: int, homes: Homes, rank: int) -> torch.Tensor:
    """Of ``rows`` routed to expert e (every rank sees the same, in token order), the block
    ``rank``'s copy takes (empty where it holds none)."""
    copies = [r for r, _ in homes.homes[e]]
    if rank not in copies:
        return rows[:0]
    j = copies.index(rank)
    cut = homes.split(e, rows.numel())
    start = sum(cut[:j])
    return rows[start:start + cut[j]]


def move_experts(params: Sequence[torch.nn.Parameter], old: Homes, new: Homes, rank: int,
                 group, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Each parameter (its rows: ``old.slots(rank)``'s experts) to ``new.slots(rank)``'s, with
    its gradient and every optimizer state tensor of its shape, gathered whole first (a
    collective: every rank, the same homes). The parameters stay the same objects. Returns
    the copies placed on a rank that held none of their expert."""
    from ._shard import replace_data

    mine = new.slots(rank)
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        follow = {k: v for k, v in state.items()
                  if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.shape}
        full = {k: gather_placed(v, old, group) for k, v in follow.items()}
        grad = None if p.grad is None else gather_placed(p.grad, old, group)
        replace_data(p, gather_placed(p.detach(), old, group)[mine].clone())
        p.grad = None if grad is None else grad[mine].clone()
        for k, v in full.items():
            state[k] = v[mine].clone()
    return sum(len({r for r, _ in b} - {r for r, _ in a})
               for a, b in zip(old.homes, new.homes))


class ReplicaGrads:
    """A parameter hook: a replicated expert's copies add their gradients (over the layer's
    group; no collective while nothing is replicated, on every rank alike). ``layer`` has
    ``homes``, ``group`` and ``info`` (plait's expert layers)."""

    def __init__(self, layer):
        import weakref

        self.layer = weakref.ref(layer)

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        layer = self.layer()
        if layer is None or not layer.homes.replicated():
            return grad
        from ..ops.context import transport_of

        return sum_replica_grads(grad.contiguous(), layer.homes, layer.info.rank,
                                 transport_of(layer.group).all_reduce)

"""Table-wise sharded embedding bags (DLRM's model-parallel embeddings) on ``embedding_all_to_all``.

Each rank owns whole tables (a :class:`~plait.plan.ShardPlan` over the tables:
rank r owns tables ``plan.slice_of(r)``, at least one each), pools them for
the whole global batch, and the all-to-all leaves every rank its slice of the
batch for every table.

==========  ===========================  ======================================
tensor      shape on rank r              note
==========  ===========================  ======================================
bags        T_r × EmbeddingBag(N_t, D)   state_dict keys ``bags.<t>.weight``,
                                         t the global table number
indices     T × [nnz_t]                  every table's bags, whole batch
offsets     T × [B]                      (EmbeddingBag's 1-D convention)
out         [B_r, T, D]                  B_r = batch_sizes[r] (default even)
==========  ===========================  ======================================

The single-device twin is any module holding ``bags``, an ``nn.ModuleList`` of
``nn.EmbeddingBag`` with one D and one mode, whose forward is
``stack_t bag_t(indices[t], offsets[t])`` → ``[B, T, D]``.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..ops.context import attempt, refused
from ..ops.library import constant_result, opaque, register_opaque
from ..ops.embedding import embedding_all_to_all
from ..ops.pieces import even_sizes
from ..plan import ShardPlan
from ._shard import GroupInfo, check_full, compute_scope, resolve_plan

__all__ = ["ShardedEmbeddingBag"]


class ShardedEmbeddingBag(nn.Module):
    """Tables ``num_embeddings[t] × embedding_dim``, whole tables per rank.

    ``overlap``: the fused ``embedding_all_to_all`` (``chunks`` pieces, "auto" by
    the cost model); False: its plain path (pool everything, then one all_to_all).
    ``batch_plan``: every rank's share of the batch (default even).
    """

    def __init__(self, num_embeddings: Sequence[int], embedding_dim: int, group=None, *,
                 plan: ShardPlan | None = None, mode: str = "sum", overlap: bool = True,
                 chunks="auto", batch_plan: ShardPlan | None = None,
                 full_weights: Sequence[torch.Tensor] | None = None, seed: int = 0,
                 dtype=None, device=None):
        super().__init__()
        sizes = [int(n) for n in num_embeddings]
        name = f"ShardedEmbeddingBag({len(sizes)} tables, D={embedding_dim})"
        if not sizes or min(sizes) < 1 or embedding_dim < 1:
            raise ValueError(f"{name}: needs at least one table, every table at least one row "
                             f"and D ≥ 1; got rows {sizes}")
        if mode not in ("sum", "mean"):
            raise ValueError(f"{name}: mode must be 'sum' or 'mean', got {mode!r}")
        if full_weights is not None:
            if len(full_weights) != len(sizes):
                raise ValueError(f"{name}: {len(full_weights)} weights for {len(sizes)} tables")
            for t, (n, w) in enumerate(zip(sizes, full_weights)):
                check_full(name, f"table {t} weight", w, (n, embedding_dim))
        self.info = GroupInfo(group)
        self.group, self.num_embeddings, self.embedding_dim = group, sizes, embedding_dim
        self.mode, self.overlap, self.chunks, self.batch_plan = mode, overlap, chunks, batch_plan
        self.plan = resolve_plan(plan, len(sizes), self.info, what="tables", layer=name)
        self.bags = nn.ModuleDict()
        for t in self.owned:
            bag = nn.EmbeddingBag(sizes[t], embedding_dim, mode=mode, dtype=dtype, device=device)
            with torch.no_grad():
                if full_weights is not None:
                    bag.weight.copy_(full_weights[t])
                else:
                    gen = torch.Generator().manual_seed(seed + t)
                    bag.weight.copy_(torch.randn(sizes[t], embedding_dim, generator=gen))
            self.bags[str(t)] = bag

    @property
    def owned(self) -> range:
        """The global numbers of this rank's tables."""
        cut = self.plan.slice_of(self.info.rank)
        return range(cut.start, cut.stop)

    @classmethod
    def from_module(cls, module, group=None, *, plan: ShardPlan | None = None, **kw):
        """The sharded twin of ``module`` (its ``bags``, or itself: a list of ``nn.EmbeddingBag``)."""
        bags = list(getattr(module, "bags", module))
        if not bags or not all(isinstance(b, nn.EmbeddingBag) for b in bags):
            raise TypeError("ShardedEmbeddingBag.from_module needs nn.EmbeddingBag tables (a "
                            f"module with .bags, or a list), got {type(module).__name__}")
        modes, dims = {b.mode for b in bags}, {b.embedding_dim for b in bags}
        if len(modes) != 1 or len(dims) != 1 or modes & {"max"}:
            raise ValueError(f"tables must share one D and mode 'sum' or 'mean'; got D {dims}, "
                             f"modes {modes}")
        w = bags[0].weight
        return cls([b.num_embeddings for b in bags], dims.pop(), group, plan=plan,
                   mode=modes.pop(), full_weights=[b.weight.detach() for b in bags],
                   dtype=w.dtype, device=w.device, **kw)

    def forward(self, indices: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor],
                batch_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Every table's bags for the whole batch → this rank's rows ``[B_r, T, D]``."""
        weights = [self.bags[str(t)].weight for t in self.owned]
        if self.info.world == 1:
            self._check_tables(indices, offsets)
            with compute_scope(weights[0].device):
                return torch.stack([F.embedding_bag(indices[t], w, offsets[t], mode=self.mode)
                                    for t, w in zip(self.owned, weights)], dim=1)
        if torch.compiler.is_compiling():  # the bags' lengths are data: pooling and all-to-all as one op
            self._check_tables(indices, offsets)  # at tracing (the op checks the rest)
            mine = [indices[t] for t in self.owned]
            bags = [offsets[t] for t in self.owned]
            sizes = self._shares(bags[0].shape[0]) if batch_sizes is None else list(batch_sizes)
            return opaque([*weights, *mine, *bags], _opaque_key(self, tuple(sizes)))
        # a bad count raised here would leave the other ranks in the operator's check:
        # its check refuses it on every rank instead
        _, problem = attempt(lambda: self._check_tables(indices, offsets))
        mine = [] if problem is not None else [indices[t] for t in self.owned]
        bags = [] if problem is not None else [offsets[t] for t in self.owned]
        first = bags[0] if bags else None
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 0
        sizes = self._shares(batch) if batch_sizes is None else list(batch_sizes)
        with compute_scope(weights[0].device), refused(problem):  # pooling and wire interleaved
            return self._exchanged(weights, mine, bags, sizes)

    def _exchanged(self, weights, mine, bags, sizes) -> torch.Tensor:
        """The fused pooling and all-to-all: every table's bags → this rank's rows."""
        return embedding_all_to_all(weights, mine, bags, self.group, batch_sizes=sizes,
                                    mode=self.mode, chunks=self.chunks if self.overlap else 1)

    def _check_tables(self, indices, offsets) -> None:
        if not isinstance(indices, (list, tuple)) or not isinstance(offsets, (list, tuple)) \
                or len(indices) != len(self.num_embeddings) or len(offsets) != len(indices):
            raise ValueError(f"ShardedEmbeddingBag: {_count(indices)} indices and "
                             f"{_count(offsets)} offsets for {len(self.num_embeddings)} tables")

    def _shares(self, batch: int) -> list[int]:
        """``batch_sizes`` unchecked: the operator checks them on every rank at once."""
        return even_sizes(batch, self.info.world) if self.batch_plan is None \
            else list(self.batch_plan.sizes)

    def batch_sizes(self, batch: int) -> list[int]:
        """Every rank's share of a batch of ``batch`` bags: the batch plan's, or even."""
        if self.batch_plan is None:
            return even_sizes(batch, self.info.world)
        if self.batch_plan.total != batch or self.batch_plan.world != self.info.world:
            raise ValueError(f"ShardedEmbeddingBag: batch_plan {list(self.batch_plan.sizes)} "
                             f"does not fit a batch of {batch} on {self.info.world} ranks")
        return list(self.batch_plan.sizes)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Every table's weight, ``bags.<t>.weight`` (a collective: every rank calls it);
        ``grads``: their gradients instead (zeros where there is none)."""
        out = {}
        for t in range(len(self.num_embeddings)):
            owner = self.plan.owner_of(t)
            if owner == self.info.rank:
                w = self.bags[str(t)].weight
                w = (w.grad if grads and w.grad is not None else
                     torch.zeros_like(w) if grads else w).detach().clone()
            else:
                w = torch.empty(self.num_embeddings[t], self.embedding_dim,
                                dtype=self.dtype, device=self.device)
            if self.info.world > 1:
                dist.broadcast(w, src=dist.get_global_rank(self.group, owner)
                               if self.group is not None else owner, group=self.group)
            out[f"bags.{t}.weight"] = w
        return out

    def to_module(self) -> nn.ModuleList:
        """The full tables as an ``nn.ModuleList`` of ``nn.EmbeddingBag`` (a collective)."""
        state = self.full_state_dict()
        bags = nn.ModuleList(nn.EmbeddingBag(n, self.embedding_dim, mode=self.mode,
                                             dtype=self.dtype, device=self.device)
                             for n in self.num_embeddings)
        with torch.no_grad():
            for t, bag in enumerate(bags):
                bag.weight.copy_(state[f"bags.{t}.weight"])
        return bags

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.bags.values())).weight.dtype

    @property
    def device(self) -> torch.device:
        return next(iter(self.bags.values())).weight.device

    def extra_repr(self) -> str:
        return (f"tables={len(self.num_embeddings)}, D={self.embedding_dim}, "
                f"plan={list(self.plan.sizes)} tables, owned={list(self.owned)}, "
                f"mode={self.mode}, {'fused' if self.overlap else 'plain'}")


@constant_result
def _opaque_key(layer: ShardedEmbeddingBag, sizes: tuple) -> str:
    """The key of ``layer``'s pooling and all-to-all at batch shares ``sizes`` as one
    registered op (``plait.ops.library.opaque``): its inputs are the owned tables' weights,
    then their indices, then their offsets."""
    ref, owned = weakref.ref(layer), len(layer.owned)

    def run(*t):
        return ref()._exchanged(list(t[:owned]), list(t[owned:2 * owned]), list(t[2 * owned:]),
                                list(sizes))

    def like(*t):
        return t[0].new_empty(sizes[layer.info.rank], len(layer.num_embeddings), t[0].shape[1])
    return register_opaque(f"embedding-{id(layer)}-{sizes}", run, like)


def _count(seq) -> str:
    return str(len(seq)) if isinstance(seq, (list, tuple)) else type(seq).__name__

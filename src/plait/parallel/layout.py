"""Where each rank's slice of each parameter sits in the full (global) tensor.

A plait layer keeps rank r's shard as one local tensor, but that tensor may be several
disjoint slices of the full one: a fused QKV weight's shard is its q-heads, k-heads and
v-heads rows (``blocks=3``), each ``plan.sizes[r] · unit`` rows long and starting at
``b · total · unit + plan.start_of(r) · unit`` of block b (``plait.nn._shard.shard_of``).
A :class:`Layout` lists those slices along the split dim as pieces
``(local_start, global_start, length)``; each piece is one contiguous box of the full
tensor and becomes one DCP chunk.

==========================  ==========================  ====================================
layer                       tensor (split dim)          pieces on rank r
==========================  ==========================  ====================================
ColumnParallelLinear        weight (0), bias (0)        one per block
RowParallelLinear           weight (1); bias whole      one
CopiedHeadsLinear           weight (0), bias (0)        one per local KV sub-group; only a
                                                        head's first copy is written
VocabParallelEmbedding      weight (0)                  one
MoE, ExpertParallelExperts  w1/w2, gate_up/down (0)     one (whole experts); placed: one
                                                        an expert, a replica's first
                                                        copy written
experts split in place      gate_up_proj (1), down (2)  two (gate, up) / one
per-head parameters         (0), its heads' entries     one (transformers' local_params)
ShardedEmbeddingBag         bags.<t>.weight             whole tables, only on their owner
==========================  ==========================  ====================================

Everything else (LayerNorms, a row-parallel bias, the router) is replicated: every rank
holds it whole (DCP keeps one copy).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..nn.record import shards_of
from ..plan import ShardPlan

__all__ = ["Layout", "model_layouts", "global_shapes", "module_plans", "rows_of"]


@dataclass(frozen=True)
class Layout:
    """A local tensor's place in its global tensor: slices of ``dim``.

    ``pieces``: ``(local_start, global_start, length, write)``; ``write`` is False for a
    piece another piece (on this or another rank) already holds (a copied KV head): it is
    read on load but not written. ``rows``: ``(first, count)`` of dim 0 when ``dim`` is not
    0 and the local tensor holds only those rows (a data-parallel shard); None: all."""

    global_shape: tuple[int, ...]
    dim: int
    pieces: tuple[tuple[int, int, int, bool], ...]
    rows: tuple[int, int] | None = None

    def boxes(self, written: bool) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """``(offsets, sizes, local_start)`` of each piece (those written, if ``written``)."""
        out = []
        if self.rows is not None and self.rows[1] == 0:
            return out
        for local, start, length, write in self.pieces:
            if written and not write:
                continue
            offsets = [0] * len(self.global_shape)
            sizes = list(self.global_shape)
            if self.rows is not None:
                offsets[0], sizes[0] = self.rows
            offsets[self.dim], sizes[self.dim] = start, length
            out.append((tuple(offsets), tuple(sizes), local))
        return out


def rows_of(layout: Layout | None, shape: tuple[int, ...], first: int, rows: int) -> Layout:
    """``layout`` (None: a tensor of ``shape`` held whole) as held by a local tensor of only
    rows ``[first, first + rows)`` of dim 0 (FSDP2's dp shard of it): a dim-0 layout's pieces
    cut to those rows, another's boxes narrowed to them along dim 0."""
    if layout is None:
        return Layout(tuple(shape), 0, ((0, first, rows, True),) if rows else ())
    if layout.dim != 0:
        assert layout.rows is None, layout
        return replace(layout, rows=(first, rows))
    pieces = []
    for local, start, length, write in layout.pieces:
        lo, hi = max(local, first), min(local + length, first + rows)
        if lo < hi:
            pieces.append((lo - first, start + lo - local, hi - lo, write))
    return Layout(layout.global_shape, 0, tuple(pieces))


def _blocked(plan: ShardPlan, rank: int, blocks: int, unit: int) -> list[tuple]:
    """The pieces of ``shard_of(full, plan, rank, blocks=, unit=)``: one per block."""
    n, per_block, start = plan.sizes[rank] * unit, plan.total * unit, plan.start_of(rank) * unit
    return [(b * n, b * per_block + start, n, True) for b in range(blocks) if n]


def _merged(pieces: list[tuple]) -> tuple[tuple[int, int, int, bool], ...]:
    """Adjacent pieces joined where they continue each other locally and globally."""
    out: list[list] = []
    for local, start, length, write in pieces:
        last = out[-1] if out else None
        if last and last[0] + last[2] == local and last[1] + last[2] == start \
                and last[3] == write:
            last[2] += length
        else:
            out.append([local, start, length, write])
    return tuple(tuple(p) for p in out)


def _layout(local: torch.Tensor, dim: int, total: int, pieces: list[tuple]) -> Layout:
    shape = list(local.shape)
    shape[dim] = total
    return Layout(tuple(shape), dim, _merged(pieces))


def _linear(layer, key: str) -> Layout | None:
    from ..nn.linear import RowParallelLinear

    param = getattr(layer, key)
    if isinstance(layer, RowParallelLinear) and key == "bias":
        return None  # replicated
    dim = layer.shard_dim if key == "weight" else 0
    plan, rank = layer.plan, layer.info.rank
    copies = getattr(layer, "copies", None)
    if copies is not None:  # CopiedHeadsLinear: sub-group u holds head u // copies
        first = plan.start_of(rank)
        pieces = [((u - first) * layer.unit, (u // copies) * layer.unit, layer.unit,
                   u % copies == 0) for u in range(first, first + plan.sizes[rank])]
        return _layout(param, dim, layer.heads_out, pieces)
    total = layer.blocks * plan.total * layer.unit
    return _layout(param, dim, total, _blocked(plan, rank, layer.blocks, layer.unit))


def _along(param: torch.Tensor, plan: ShardPlan, rank: int, dim: int,
           blocks: int = 1, unit: int = 1) -> Layout:
    return _layout(param, dim, blocks * plan.total * unit, _blocked(plan, rank, blocks, unit))


def _module_layouts(module: nn.Module) -> dict[str, Layout | None] | None:
    """``{parameter key: Layout}`` of a sharded module (None: replicated), or None for a
    module that shards nothing itself."""
    from ..nn.embedding import ShardedEmbeddingBag
    from ..nn.linear_base import _ParallelLinear
    from ..nn.moe import MoE
    from .experts import ExpertParallelExperts
    from .layers import VocabParallelEmbedding

    in_place = shards_of(module)
    if in_place is not None:  # experts split by their FFN dim, or per-head parameters
        rank = _rank(in_place.group)
        return {k: _along(getattr(module, k), in_place.plan, rank, dim, blocks, unit)
                for k, (dim, blocks, unit) in in_place.dims.items()}
    if isinstance(module, _ParallelLinear):
        keys = ["weight"] + (["bias"] if module.bias is not None else [])
        return {k: _linear(module, k) for k in keys}
    if isinstance(module, VocabParallelEmbedding):
        return {"weight": _along(module.weight, module.plan, module.info.rank, 0)}
    if isinstance(module, (MoE, ExpertParallelExperts)) and module.placed:  # one piece a slot
        rank, homes = module.info.rank, module.homes
        pieces = [(i, e, 1, homes.homes[e][0][0] == rank)  # a replica's first copy writes
                  for i, e in enumerate(homes.slots(rank))]
        keys = ("w1", "w2") if isinstance(module, MoE) else ("gate_up_proj", "down_proj")
        return {k: _layout(getattr(module, k), 0, homes.experts, pieces) for k in keys}
    if isinstance(module, MoE):
        return {k: _along(getattr(module, k), module.plan, module.info.rank, 0)
                for k in ("w1", "w2")}
    if isinstance(module, ExpertParallelExperts):
        return {k: _along(getattr(module, k), module.plan, module.info.rank, 0)
                for k in ("gate_up_proj", "down_proj")}
    if isinstance(module, ShardedEmbeddingBag):
        return {}  # whole tables, each held by its owner only: plain tensors
    if hasattr(module, "full_state_dict"):
        raise TypeError(f"plait.checkpoint does not know where the shards of a "
                        f"{type(module).__name__} sit in its full tensors")
    return None


def _rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def model_layouts(model: nn.Module) -> dict[str, Layout]:
    """``{state_dict name: Layout}`` of every sharded tensor of ``model`` (the others are
    held whole)."""
    out: dict[str, Layout] = {}
    for name, module in model.named_modules():
        found = _module_layouts(module)
        prefix = f"{name}." if name else ""
        for key, layout in (found or {}).items():
            if layout is not None:
                out[prefix + key] = layout
    return out


def global_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every state_dict tensor's full shape, by name, as a single-device model holds it
    (no collective: ShardedEmbeddingBag's tables held elsewhere are named too)."""
    from ..nn.embedding import ShardedEmbeddingBag

    layouts = model_layouts(model)
    shapes = {k: list(layouts[k].global_shape) if k in layouts else list(v.shape)
              for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, ShardedEmbeddingBag):
            prefix = f"{name}." if name else ""
            for t, rows in enumerate(module.num_embeddings):
                shapes[f"{prefix}bags.{t}.weight"] = [rows, module.embedding_dim]
    return dict(sorted(shapes.items()))


def module_plans(model: nn.Module) -> dict[str, list[int]]:
    """``{module name: plan sizes}`` of every module with a plan (what the balancer moved)."""
    out = {}
    for name, module in model.named_modules():
        plan = getattr(module, "plan", None)
        if plan is None:
            plan = getattr(shards_of(module), "plan", None)
        if isinstance(plan, ShardPlan):
            out[name] = list(plan.sizes)
    return out

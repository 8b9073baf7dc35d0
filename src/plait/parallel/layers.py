"""The layers ``parallelize`` needs beyond ``plait.nn``'s: copied K/V heads, a vocabulary-parallel
embedding, and transformers' fused experts split by their FFN dim.

CopiedHeadsLinear (a K/V projection when there are fewer KV heads than ranks):

==================  ======================  ==========================================
tensor              shape on rank r         note
==================  ======================  ==========================================
weight, bias        [u_r · hd, K], [u_r·hd]  u_r sub-groups of the plan, each a copy of
                                            its K/V head (head u // copies)
y                   [B, S, u_r · hd]        one K/V head per local sub-group
==================  ======================  ==========================================

A column-parallel layer over the copied weight ``W'[u] = W[u // copies]``: the
forward is exactly the head's. Each copy's gradient is the part from its own
query heads; a hook sums the copies' (all-gather of the copied gradient, a sum
per head, in a fixed order on every rank), so every copy gets the head's whole
gradient and the copies stay equal under any optimizer. ``full_state_dict``
gives the original [kv_heads · hd, K] weight (the first copy of each head).

VocabParallelEmbedding: ``weight`` [V_r, D] (rows ``plan.slice_of(r)``); ids
outside this rank's rows look up zeros, and the ranks' lookups are summed
(all-reduce), or reduce-scattered along the sequence (``seq_dim``): the
lookup of every id comes from exactly one rank. ``scale``: the sum multiplied
by it, as a scaled embedding (Gemma's ``embed_scale``) does its lookup.

Experts split by their FFN dim (``shard_experts_ffn``, in place): transformers'
fused experts keep their class and forward (any of its experts
implementations) on ``gate_up_proj`` [E, 2 F_r, H] (this rank's F_r columns
of gate and of up) and ``down_proj`` [E, H, F_r]; the tokens and routing weights
come in replicated (their gradients are all-reduced: ``copy_to_region``), and
the partial outputs are summed (``reduce_from_region``). The routing weights
(float32 from Mixtral's router even in a float64 model) are taken in the
tokens' dtype, the exact same values, so their gradient's partial sums are
added before the one rounding to float32 the single-device model makes.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn._shard import GroupInfo, resolve_plan, shard_of, unshard
from ..nn.linear import ColumnParallelLinear
from ..nn.record import set_shards
import torch.distributed as dist

from ..ops.regions import copy_to_region, reduce_from_region, reduce_scatter_region
from ..plan import ShardPlan

__all__ = ["CopiedHeadsLinear", "VocabParallelEmbedding", "shard_experts_ffn", "experts_shape",
           "shard_local_params", "sum_tail_grad"]


class CopiedHeadsLinear(ColumnParallelLinear):
    """A K/V projection whose heads are copied into ``copies`` sub-groups; see the module doc."""

    defer_wgrad = False  # its gradient hook sums the copies: the gradient goes through autograd

    @classmethod
    def from_module(cls, linear: nn.Linear, group=None, *, plan: ShardPlan | None = None,
                    copies: int = 1, unit: int = 1, **kw):
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_module needs an nn.Linear, got "
                            f"{type(linear).__name__}")
        heads = linear.out_features // unit
        index = torch.arange(heads).repeat_interleave(copies)  # sub-group u reads head u // copies
        rows = (index[:, None] * unit + torch.arange(unit)).reshape(-1).to(linear.weight.device)
        w = linear.weight.detach().index_select(0, rows)
        b = None if linear.bias is None else linear.bias.detach().index_select(0, rows)
        layer = cls(linear.in_features, heads * copies * unit, group, bias=b is not None, plan=plan,
                    full_weight=w, full_bias=b, dtype=w.dtype, device=w.device, unit=unit,
                    unit_name="KV sub-groups", **kw)
        layer.copies, layer.heads_out = copies, linear.out_features
        for param in layer.parameters():
            param.register_hook(layer._sum_copies)
        return layer

    def _sum_copies(self, grad: torch.Tensor) -> torch.Tensor:
        full = unshard(grad, self.plan, self.group, 0, unit=self.unit)  # [heads·copies·hd, ...]
        per_head = full.reshape(-1, self.copies, self.unit, *full.shape[1:])
        summed = per_head.sum(dim=1, keepdim=True).expand_as(per_head).reshape(full.shape)
        return shard_of(summed, self.plan, self.info.rank, 0, unit=self.unit)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The original projection's ``weight``/``bias`` (the first copy of each head)."""
        out = super().full_state_dict(grads)
        return {k: v.reshape(-1, self.copies, self.unit, *v.shape[1:])[:, 0]
                .reshape(self.heads_out, *v.shape[1:]) for k, v in out.items()}

    def to_module(self) -> nn.Linear:
        state = self.full_state_dict()
        linear = nn.Linear(self.in_features, self.heads_out, bias=self.bias is not None,
                           dtype=self.weight.dtype, device=self.weight.device)
        linear.load_state_dict(state)
        return linear

    def check_plan(self, plan: ShardPlan) -> ShardPlan:
        raise ValueError(f"{type(self).__name__}: K/V heads copied over {self.copies} sub-groups "
                         "cannot migrate (their copies would move apart)")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", each K/V head copied {self.copies}×"


class VocabParallelEmbedding(nn.Module):
    """An nn.Embedding whose rows are split by ``plan``; see the module docstring."""

    def __init__(self, embedding: nn.Embedding, group=None, *, plan: ShardPlan | None = None,
                 seq_dim: int | None = None, seq_plan: ShardPlan | None = None,
                 scale: torch.Tensor | float | None = None):
        super().__init__()
        name = f"VocabParallelEmbedding({embedding.num_embeddings}, {embedding.embedding_dim})"
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{name}: needs an nn.Embedding, got {type(embedding).__name__}")
        if embedding.max_norm is not None or embedding.sparse:
            raise ValueError(f"{name}: max_norm and sparse embeddings are not supported")
        self.info, self.group = GroupInfo(group), group
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.plan = resolve_plan(plan, self.num_embeddings, self.info, what="vocabulary rows",
                                 layer=name)
        self.seq_dim, self.seq_plan = seq_dim, seq_plan
        rows = shard_of(embedding.weight.detach(), self.plan, self.info.rank, 0)  # [V_r, D]
        self.weight = nn.Parameter(rows)
        # a scaled embedding's forward (Gemma's: lookup · embed_scale in the weight's dtype);
        # scaling the summed lookup is exact: every row comes from one rank, the rest are 0
        self.scale = None if scale is None else torch.as_tensor(scale).detach().clone()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = self.plan.slice_of(self.info.rank)
        # this rank's rows looked up, every other id's row 0 (six small ops: a decoding
        # step makes them every token); where, not a product with the mask, so a row of
        # inf or NaN owned elsewhere leaves no NaN here
        local = ids - mine.start
        kept = local.clamp(0, max(mine.stop - mine.start - 1, 0))
        pad = self.padding_idx
        pad = pad - mine.start if pad is not None and mine.start <= pad < mine.stop else None
        out = torch.where((kept == local).unsqueeze(-1),
                          F.embedding(kept, self.weight, pad), 0.0)
        if self.seq_dim is None:
            out = reduce_from_region(out, self.group)  # [..., D], each id's row from its owner
        else:
            sizes = None if self.seq_plan is None else list(self.seq_plan.sizes)
            out = reduce_scatter_region(out, self.group, self.seq_dim, sizes)  # [B, S_r, D]
        if self.scale is not None:
            out = out * self.scale.to(device=out.device, dtype=self.weight.dtype)
        return out

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        w = self.weight
        value = w.detach() if not grads else torch.zeros_like(w) if w.grad is None else w.grad
        return {"weight": unshard(value.detach(), self.plan, self.group, 0)}

    def extra_repr(self) -> str:
        out = "all-reduced" if self.seq_dim is None else \
            f"reduce-scattered along dim {self.seq_dim}"
        scaled = "" if self.scale is None else f", scaled by {float(self.scale):g}"
        return (f"{self.num_embeddings}, {self.embedding_dim}, plan={list(self.plan.sizes)} rows, "
                f"{out}{scaled}")


def experts_shape(module: nn.Module, path: str) -> tuple[int, int, int]:
    """(experts, hidden, ffn) of transformers' fused experts; a ValueError naming what is not
    a layout plait splits ([gate | up] concatenated, no biases; [E, 2F, H] and [E, H, F], or
    with ``is_transposed`` [E, H, 2F] and [E, F, H])."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) \
            or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{path}: {type(module).__name__} is not transformers' fused experts "
                         "(3-D gate_up_proj [E, 2F, H] and down_proj [E, H, F])")
    bad = [f"{a}={getattr(module, a)}" for a, ok in
           (("is_concatenated", True), ("has_bias", False), ("has_gate", True))
           if getattr(module, a, ok) != ok]
    if bad:
        raise ValueError(f"{path}: experts with {', '.join(bad)} are not supported (plait splits "
                         "[gate | up] concatenated, [E, 2F, H], without biases)")
    if getattr(module, "is_transposed", False):
        e, h, two_f = gate_up.shape
        want, names = (e, two_f // 2, h), "[E, H, 2F] and [E, F, H] (is_transposed)"
    else:
        e, two_f, h = gate_up.shape
        want, names = (e, h, two_f // 2), "[E, 2F, H] and [E, H, F]"
    if two_f % 2 or tuple(down.shape) != want:
        raise ValueError(f"{path}: gate_up_proj {tuple(gate_up.shape)} and down_proj "
                         f"{tuple(down.shape)} are not {names}")
    return e, h, two_f // 2


def _ffn_dims(module: nn.Module) -> dict[str, tuple[int, int, int]]:
    """Per experts parameter: the dim its FFN columns run along, its blocks, and 1 (a plan
    unit is one column)."""
    if getattr(module, "is_transposed", False):
        return {"gate_up_proj": (2, 2, 1), "down_proj": (1, 1, 1)}
    return {"gate_up_proj": (1, 2, 1), "down_proj": (2, 1, 1)}


class _ExpertShards:
    """What ``full_state_dict`` needs to gather experts split in place: each parameter's
    split dim and blocks, the plan and the group."""

    def __init__(self, module: nn.Module, plan: ShardPlan, group):
        self.module, self.plan, self.group = module, plan, group
        self.dims = _ffn_dims(module)

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for name, (dim, blocks, _) in self.dims.items():
            p = getattr(self.module, name)
            value = p.detach() if not grads else torch.zeros_like(p) if p.grad is None else p.grad
            out[name] = unshard(value.detach(), self.plan, self.group, dim, blocks=blocks)
        return out


class _SumTail(torch.autograd.Function):
    """Identity forward; backward: the last ``tail`` features' gradient summed over ranks."""

    @staticmethod
    def forward(ctx, x, tail, group):
        ctx.tail, ctx.group = tail, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        part = grad[..., grad.shape[-1] - ctx.tail:].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., grad.shape[-1] - ctx.tail:] = part
        return grad, None, None


def sum_tail_grad(module: nn.Module, tail: int, group=None):
    """The last ``tail`` output features of ``module`` are read by a rank's share of the
    heads (multi-head latent attention's rotary key): their gradient is summed over the
    ranks, so the module's weights and input get the whole of it (``mla_kv_a_proj``)."""
    return module.register_forward_hook(lambda m, a, out: _SumTail.apply(out, tail, group))


class _LocalShards:
    """``full_state_dict`` of an attention module's per-head parameters split in place."""

    def __init__(self, module: nn.Module, units: dict[str, int], plan: ShardPlan, group):
        self.module, self.units, self.plan, self.group = module, units, plan, group
        self.dims = {name: (0, 1, unit) for name, unit in units.items()}  # dim 0, one block

    def full_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for name, unit in self.units.items():
            p = getattr(self.module, name)
            value = p.detach() if not grads else torch.zeros_like(p) if p.grad is None else p.grad
            out[name] = unshard(value.detach(), self.plan, self.group, 0, unit=unit)
        return out


def shard_local_params(module: nn.Module, units: dict[str, int], plan: ShardPlan,
                       group=None) -> None:
    """Keep this rank's heads of each per-head parameter (``units``: name → query heads per
    plan unit), in place; ``full_state_dict`` gathers them back."""
    rank = GroupInfo(group).rank
    for name, unit in units.items():
        full = getattr(module, name)
        local = shard_of(full.detach(), plan, rank, 0, unit=unit)
        setattr(module, name, nn.Parameter(local, requires_grad=full.requires_grad))
    set_shards(module, _LocalShards(module, units, plan, group))


def shard_experts_ffn(module: nn.Module, path: str, group=None,
                      plan: ShardPlan | None = None) -> ShardPlan:
    """Split transformers' fused experts by their FFN dim, in place (see the module docstring)."""
    e, h, f = experts_shape(module, path)
    info = GroupInfo(group)
    plan = resolve_plan(plan, f, info, what="expert FFN columns", layer=path)
    (gu_dim, *_), (down_dim, *_) = _ffn_dims(module).values()
    with torch.no_grad():
        gate_up = shard_of(module.gate_up_proj.detach(), plan, info.rank, gu_dim, blocks=2)
        down = shard_of(module.down_proj.detach(), plan, info.rank, down_dim)
    module.gate_up_proj = nn.Parameter(gate_up, requires_grad=module.gate_up_proj.requires_grad)
    module.down_proj = nn.Parameter(down, requires_grad=module.down_proj.requires_grad)
    if hasattr(module, "intermediate_dim"):
        module.intermediate_dim = plan.sizes[info.rank]
    set_shards(module, _ExpertShards(module, plan, group))

    def enter(mod, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        dtype = (args[0] if args else kwargs["hidden_states"]).dtype
        for i, name in ((0, "hidden_states"), (2, "top_k_weights")):
            if len(args) > i:
                args[i] = copy_to_region(args[i].to(dtype), group)
            elif name in kwargs:
                kwargs[name] = copy_to_region(kwargs[name].to(dtype), group)
        return tuple(args), kwargs

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(lambda mod, args, out: reduce_from_region(out, group))
    return plan

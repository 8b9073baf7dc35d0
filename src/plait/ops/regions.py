"""The plain (unfused) collectives at the edges of a parallel region, autograd-aware.

These are Megatron-LM's mappings (``mappings.py``), the reference path that
the fused operators are measured and tested against, and the boundaries of a
sequence-parallel or token-parallel region:

=======================  ==========================  =========================
function                 forward                     backward
=======================  ==========================  =========================
copy_to_region           identity                    all_reduce
reduce_from_region       all_reduce                  identity
scatter_to_region        keep own slice of ``dim``   all_gather along ``dim``
gather_from_region       all_gather along ``dim``    keep own slice
gather_for_matmul        all_gather along ``dim``    reduce_scatter along ``dim``
reduce_scatter_region    reduce_scatter along dim    all_gather along ``dim``
=======================  ==========================  =========================

``sizes``: every rank's length along ``dim`` (uneven allowed; default even
for a scatter, as found for a gather). Reductions sum in rank order, so
results are deterministic. One rank: every function is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
import torch.distributed as dist

from .agree import Check, dtype_code
from .context import attempt, carries_checks, get_context, signature, transport_of
from .exchange import start_gather
from .library import define, group_key, group_of
from .pieces import even_sizes, offsets
from ..transport.calls import Carried

__all__ = ["copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
           "gather_for_matmul", "reduce_scatter_region", "RegionCheck"]


def _world(group) -> int:
    return dist.get_world_size(group)


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with ``dim`` leading, as [L, rest] (contiguous). Where every dim before ``dim``
    has one element (a decoding step's [1, 1, V_r] logits) that is x's own order: no
    movedim."""
    lead = math.prod(x.shape[:dim])
    rest = lead * math.prod(x.shape[dim + 1:])
    if lead == 1:
        return x.reshape(x.shape[dim], rest).contiguous()
    return x.movedim(dim, 0).reshape(x.shape[dim], rest).contiguous()


def _unrows(rows: torch.Tensor, like: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``_rows``' inverse: ``rows`` ([length, rest]) in ``like``'s layout along ``dim``."""
    if math.prod(like.shape[:dim]) == 1:
        return rows.view(*like.shape[:dim], length, *like.shape[dim + 1:])
    shape = list(like.movedim(dim, 0).shape)
    shape[0] = length
    return rows.view(shape).movedim(0, dim)


def _all_gather(x: torch.Tensor, dim: int, sizes: Sequence[int], group,
                check=None) -> torch.Tensor:
    rows = _rows(x, dim)
    out = rows.new_empty(sum(sizes), rows.shape[1])
    if check is not None:  # shared memory, the check in the data call's header
        transport_of(group).all_gather(out, rows, list(sizes), check=check)
    else:
        start_gather(out, rows, list(sizes), group).wait()
    return _unrows(out, x, dim, sum(sizes))


def _reduce_scatter(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Σ_ranks x, keeping this rank's ``sizes[rank]`` rows of ``dim``: one all_to_all, then a
    rank-ordered sum (gloo's reduce_scatter moves as much data as an all_reduce)."""
    rows = _rows(x, dim)
    mine = sizes[dist.get_rank(group)]
    out = rows.new_empty(mine, rows.shape[1])
    transport_of(group).reduce_scatter(out, rows, list(sizes))
    return _unrows(out, x, dim, mine)


def _own(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    at = offsets(sizes)
    rank = dist.get_rank(group)
    return x.narrow(dim, at[rank], sizes[rank]).contiguous()


def _split_sizes(x: torch.Tensor, dim: int, sizes, group) -> list[int]:
    sizes = even_sizes(x.shape[dim], _world(group)) if sizes is None else [int(s) for s in sizes]
    if len(sizes) != _world(group) or sum(sizes) != x.shape[dim] or min(sizes) < 0:
        raise ValueError(f"sizes {sizes} must give each of {_world(group)} ranks a share of "
                         f"dim {dim}, whose length is {x.shape[dim]}")
    return sizes


@dataclass(frozen=True)
class RegionCheck(Check):
    """A region collective's check (:func:`_agreed`): its dtype, the size of its other dims
    (of a whole tensor, its elements), whether a backward collective follows, its length
    along ``dim``, and every rank's share of ``dim`` (-1 each where the shares are as
    found). All but the length must agree; the length too where x is split."""

    dtype: int
    others: int
    needs_grad: int
    length: int
    shares: tuple
    AGREED: ClassVar = ("dtype", "others", "needs_grad", "shares")
    PER_RANK: ClassVar = frozenset({"shares"})
    LABELS: ClassVar = {"others": "other dims", "needs_grad": "needs grad", "shares": "sizes"}


def _agreed(op: str, x, group, dim: int | None, sizes, *, split: bool,
            needs_grad: bool = False) -> list[int]:
    """Every rank's length along ``dim``, once every rank agrees on all the wire will carry
    (dtype, the other dims, ``sizes``, whether a backward collective follows): one small
    gather, refused on every rank if any rank's input is bad or they differ.

    ``dim`` None: the whole tensor (an all-reduce). ``split``: x is whole on every rank
    and ``sizes`` (default even) cut its ``dim``; else x is this rank's share and
    ``sizes`` (default: as found) are every rank's shares.
    """
    row, problem, shares = _row(op, x, group, dim, sizes, split=split, needs_grad=needs_grad)
    metas = get_context(group).gather_meta(
        op, RegionCheck.width(_world(group)), row, problem,
        lambda rows: _verify(op, rows, dim, split, shares))
    return _verify(op, metas, dim, split, shares)


def _row(op: str, x, group, dim: int | None, sizes, *, split: bool, needs_grad: bool = False):
    """This rank's part of ``_agreed``'s check: (row, problem, its shares or None)."""
    world, rank = _world(group), dist.get_rank(group)
    got = {}

    def local():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: x must be a tensor, got {type(x).__name__}")
        if dim is None:
            return RegionCheck(dtype_code(x.dtype), x.numel(), int(needs_grad), 0,
                               (-1,) * world).row()
        if not -x.dim() <= dim < max(1, x.dim()):
            raise ValueError(f"{op}: dim {dim} is not a dim of x {tuple(x.shape)}")
        d = dim % x.dim()
        length, others = x.shape[d], math.prod(x.shape[:d]) * math.prod(x.shape[d + 1:])
        try:
            shares = [int(s) for s in sizes] if sizes is not None else \
                even_sizes(length, world) if split else None
        except (TypeError, ValueError):
            raise TypeError(f"{op}: sizes must be integers, one per rank, got {sizes!r}") \
                from None
        if shares is not None:
            if len(shares) != world or min(shares) < 0:
                raise ValueError(f"{op}: sizes {shares} must give each of {world} ranks a "
                                 "non-negative share")
            if (sum(shares) if split else shares[rank]) != length:
                raise ValueError(f"{op}: sizes {shares} do not fit dim {d} of x "
                                 f"{tuple(x.shape)} on rank {rank}")
        got["shares"] = shares
        return RegionCheck(dtype_code(x.dtype), others, int(needs_grad), length,
                           tuple(shares) if shares is not None else (-1,) * world).row()
    row, problem = attempt(local)
    return row, problem, got.get("shares")


def _verify(op: str, metas, dim: int | None, split: bool, shares) -> list[int]:
    """``_agreed``'s verdict on every rank's row (the same on every rank): raises where
    they differ; every rank's length along ``dim``."""
    RegionCheck.agree(op, metas, labels={"others": "elements"} if dim is None else None)
    if split:
        RegionCheck.agree(op, metas, ("length",))
    return shares if shares is not None else [c.length for c in RegionCheck.from_rows(metas)]


def _carried(op: str, x, group, dim: int | None, sizes, *, split: bool, world: int):
    """On shared memory, ``_agreed``'s check as the ``check`` a data call carries in its
    header (no call of its own); None elsewhere, or where the call cannot carry it. A rank
    whose own input is bad raises here, and so do its peers, in their data call. Made
    once per signature (:meth:`plait.ops.context.OpsContext.carried_plan`)."""
    ctx = get_context(group)
    if not carries_checks(ctx):
        return None
    key = _signature(op, x, dim, sizes, split)

    def make():
        row, problem, shares = _row(op, x, group, dim, sizes, split=split)
        if problem is not None:
            raise problem
        names = tuple(f"f{i}" for i in range(len(row)))
        return Carried(op, names, row, lambda metas: _verify(op, metas, dim, split, shares))
    check, problem = ctx.carried_plan(key, make)
    if problem is not None:
        ctx.gather_meta(op, RegionCheck.width(world), None, problem)  # raises
    return check


def _signature(op: str, x, dim, sizes, split: bool) -> tuple | None:
    """``_carried``'s cache key; None (never cached: ``_row`` then refuses a bad ``dim`` or
    ``sizes`` on every rank) where ``sizes`` is not a sequence of integers or ``dim`` not
    hashable: raised here, on this rank alone, it would leave its peers in the data call."""
    key = signature(op, x)
    if key is None or not isinstance(sizes, (list, tuple, type(None))):
        return None
    try:
        key = (*key, dim, None if sizes is None else tuple(int(s) for s in sizes), split)
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        dy = dy.contiguous().clone()
        transport_of(ctx.group).all_reduce(dy)
        return dy, None


def _reduced(x: torch.Tensor, group, check=None) -> torch.Tensor:
    # a transport that carries checks has this one in the data call's header; elsewhere
    # (check None) it ran already
    return transport_of(group).summed(x, check=check)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, check=None):
        return _reduced(x, group, check)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _own(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.sizes, ctx.group), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes, reduce_grad, check=None):
        ctx.group, ctx.dim, ctx.sizes, ctx.reduce_grad = group, dim, sizes, reduce_grad
        return _all_gather(x, dim, sizes, group, check)

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce_grad:
            return _reduce_scatter(dy, ctx.dim, ctx.sizes, ctx.group), None, None, None, None, None
        return _own(dy, ctx.dim, ctx.sizes, ctx.group), None, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, sizes):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        return _reduce_scatter(x, dim, sizes, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.sizes, ctx.group), None, None, None


# --- under torch.compile: the same mappings on plait's registered ops (ops.library) -----
class _CopyTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.ops.plait.all_reduce(dy, ctx.group), None


class _ReduceTraced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: str):
        return torch.ops.plait.all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _GatherTraced(torch.autograd.Function):
    """All-gather along ``dim``; the backward keeps this rank's slice (``reduce_grad``:
    reduce-scatters it, ahead of a column-parallel matmul)."""

    @staticmethod
    def forward(ctx, x, group: str, dim: int, sizes: tuple, rank: int, reduce_grad: bool):
        ctx.group, ctx.dim, ctx.sizes, ctx.rank, ctx.reduce_grad = \
            group, dim, sizes, rank, reduce_grad
        return torch.ops.plait.all_gather(x, group, dim, list(sizes))

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce_grad:
            dx = torch.ops.plait.reduce_scatter(dy, ctx.group, ctx.dim, list(ctx.sizes))
        else:
            dx = dy.narrow(ctx.dim, sum(ctx.sizes[:ctx.rank]), ctx.sizes[ctx.rank])
        return dx, None, None, None, None, None


class _ScatterTraced(torch.autograd.Function):
    """This rank's slice (``reduce``: of the sum over ranks) along ``dim``; the backward
    all-gathers."""

    @staticmethod
    def forward(ctx, x, group: str, dim: int, sizes: tuple, rank: int, reduce: bool):
        ctx.group, ctx.dim, ctx.sizes = group, dim, sizes
        if reduce:
            return torch.ops.plait.reduce_scatter(x, group, dim, list(sizes))
        return x.narrow(dim, sum(sizes[:rank]), sizes[rank]).contiguous()

    @staticmethod
    def backward(ctx, dy):
        return torch.ops.plait.all_gather(dy.contiguous(), ctx.group, ctx.dim,
                                          list(ctx.sizes)), None, None, None, None, None


def _traced_sizes(x: torch.Tensor, dim: int, sizes, group, split: bool) -> tuple:
    """Every rank's length along ``dim`` at trace time: given, or even (a split), or this
    rank's own repeated (a gather of equal shares; the op checks it when it runs)."""
    if sizes is not None:
        return tuple(int(s) for s in sizes)
    if split:
        return tuple(even_sizes(x.shape[dim], _world(group)))
    return (x.shape[dim],) * _world(group)


def copy_to_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity; the backward all-reduces (entry of a tensor-parallel region, replicated x)."""
    if _world(group) == 1:
        return x
    if torch.compiler.is_compiling():
        return _CopyTraced.apply(x, group_key(group))
    if torch.is_grad_enabled():  # the backward's all-reduce is agreed here
        _agreed("copy_to_region", x, group, None, None, split=False, needs_grad=x.requires_grad)
    return _Copy.apply(x, group)


def reduce_from_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum); the backward is the identity (exit of a tensor-parallel region)."""
    world = _world(group)
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        return _ReduceTraced.apply(x, group_key(group))
    check = _carried("reduce_from_region", x, group, None, None, split=False, world=world)
    if check is None:
        _agreed("reduce_from_region", x, group, None, None, split=False)
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: the forward alone
        return _reduced(x, group, check)
    return _Reduce.apply(x, group, check)


def scatter_to_region(x: torch.Tensor, group=None, dim: int = 0,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """This rank's slice of a replicated ``x`` along ``dim``; the backward all-gathers, so
    every rank gets the whole (replicated) gradient."""
    if _world(group) == 1:
        return x
    if torch.compiler.is_compiling():
        d = dim % x.dim()
        return _ScatterTraced.apply(x, group_key(group), d, _traced_sizes(x, d, sizes, group, True),
                                    dist.get_rank(group), False)
    if torch.is_grad_enabled():  # the backward's gather is agreed here
        sizes = _agreed("scatter_to_region", x, group, dim, sizes, split=True,
                        needs_grad=x.requires_grad)
    else:
        sizes = _split_sizes(x, dim % x.dim(), sizes, group)  # nothing crosses ranks
    return _Scatter.apply(x, group, dim % x.dim(), sizes)


def gather_from_region(x: torch.Tensor, group=None, dim: int = 0,
                       sizes: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather ``x`` along ``dim``; the backward keeps this rank's slice (the gradient of
    the gathered tensor is replicated: every rank computed the same loss from it)."""
    world = _world(group)
    if world == 1:
        return x
    if torch.compiler.is_compiling():
        d = dim % x.dim()
        return _GatherTraced.apply(x, group_key(group), d,
                                   _traced_sizes(x, d, sizes, group, False),
                                   dist.get_rank(group), False)
    check = None if sizes is None else \
        _carried("gather_from_region", x, group, dim, sizes, split=False, world=world)
    if check is None:  # sizes found by the check: it comes first
        sizes = _agreed("gather_from_region", x, group, dim, sizes, split=False)
    else:
        sizes = [int(s) for s in sizes]
    if not (torch.is_grad_enabled() and x.requires_grad):  # no backward: the forward alone
        return _all_gather(x, dim % x.dim(), sizes, group, check)
    return _Gather.apply(x, group, dim % x.dim(), sizes, False, check)


def gather_for_matmul(x: torch.Tensor, group=None, dim: int = 0,
                      sizes: Sequence[int] | None = None) -> torch.Tensor:
    """All-gather ``x`` along ``dim`` ahead of a column-parallel matmul; the backward
    reduce-scatters (each rank's gradient is a partial sum over its column shard)."""
    if _world(group) == 1:
        return x
    if torch.compiler.is_compiling():
        d = dim % x.dim()
        return _GatherTraced.apply(x, group_key(group), d,
                                   _traced_sizes(x, d, sizes, group, False),
                                   dist.get_rank(group), True)
    sizes = _agreed("gather_for_matmul", x, group, dim, sizes, split=False,
                    needs_grad=torch.is_grad_enabled() and x.requires_grad)
    return _Gather.apply(x, group, dim % x.dim(), sizes, True)


def reduce_scatter_region(x: torch.Tensor, group=None, dim: int = 0,
                          sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Sum over ranks and keep this rank's slice of ``dim``; the backward all-gathers."""
    if _world(group) == 1:
        return x
    if torch.compiler.is_compiling():
        d = dim % x.dim()
        return _ScatterTraced.apply(x, group_key(group), d, _traced_sizes(x, d, sizes, group, True),
                                    dist.get_rank(group), True)
    sizes = _agreed("reduce_scatter_region", x, group, dim, sizes, split=True,
                    needs_grad=torch.is_grad_enabled() and x.requires_grad)
    return _ReduceScatter.apply(x, group, dim % x.dim(), sizes)


# --- the registered ops the traced mappings above call (plait.ops.library) ------------
def _gathered(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    with torch.no_grad():  # contiguous, as the fake says (a gather along dim > 0 is a view)
        return gather_from_region(x, group_of(group), dim, list(sizes)).contiguous()


def _gathered_like(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    return x.new_empty(shape)


def _scattered(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reduce_scatter_region(x, group_of(group), dim, list(sizes)).contiguous()


def _scattered_like(x: torch.Tensor, group: str, dim: int, sizes: list[int]) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = sizes[dist.get_rank(group_of(group))]
    return x.new_empty(shape)


define("all_gather(Tensor x, str group, int dim, int[] sizes) -> Tensor", _gathered,
       _gathered_like)
define("reduce_scatter(Tensor x, str group, int dim, int[] sizes) -> Tensor", _scattered,
       _scattered_like)

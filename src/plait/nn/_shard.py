"""What every sharded layer shares: its group, its plan, slicing a full weight and gathering it back.

A layer's sharded parameters are always derivable from (full weight, plan):
``shard_of`` cuts rank r's slice, ``unshard`` gathers every rank's slice back
into the full tensor. ``reshard`` (a new plan) is exactly these two.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from ..plan import ShardPlan
from ..runtime import current as _current
from .record import is_partial, mark_partial

__all__ = ["GroupInfo", "group_info", "compute_scope", "straggled", "pieces", "shard_of", "unshard", "mark_partial_grad",
           "replace_data", "resolve_plan", "check_full"]


class GroupInfo:
    """(rank, world) of a group. Without torch.distributed initialised there is no group: a
    layer built then would silently run as a world of one on every process (each rank the
    whole model), so it is refused."""

    def __init__(self, group=None):
        self.group = group
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("plait's parallel layers need torch.distributed initialised: call "
                             "plait.runtime.init_from_env() (under torchrun) or "
                             "torch.distributed.init_process_group() first; a process on its "
                             "own is a world of one of them (init_from_env() without torchrun)")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)


def group_info(group=None) -> GroupInfo:
    return GroupInfo(group)


def _idle(timer) -> bool:
    """Nothing times this region and nothing slows this rank: the region may be skipped (a
    decoding step enters a few hundred; each costs a few microseconds of Python)."""
    if timer is not None:
        return False
    ctx = _current.get()
    straggler = None if ctx is None else ctx.straggler
    return straggler is None or (not straggler.specs and straggler.throttle is None)


def compute_scope(device: torch.device | None = None, timer=None, work: float = 0.0):
    """A layer's local compute region: the rank's straggler emulation (a no-op outside a group)
    and, when the layer has a ``compute_timer`` (``plait.balance.SpeedMonitor.attach``), its
    timing, which includes the emulated delay: a slow rank is measured slow."""
    if _idle(timer):
        return contextlib.nullcontext()
    return _scope(device, timer, work)


@contextlib.contextmanager
def _scope(device, timer, work: float) -> Iterator[None]:
    region = _Region(device, timer, work)
    region.open()
    try:
        yield
    finally:
        region.close()


class _Region:
    """A compute region that may open in one autograd node and close in another."""

    def __init__(self, device, timer=None, work: float = 0.0):
        self.device, self.timer, self.work = device, timer, work
        self.open_cm = self.token = None

    def open(self) -> None:
        if self.timer is not None:  # outermost, so the straggler's sleep is inside it
            self.token = self.timer.begin(self.device)
        if dist.is_available() and dist.is_initialized():
            from ..runtime import rank_context

            self.open_cm = rank_context().straggler.compute(self.device)
            self.open_cm.__enter__()

    def close(self) -> None:
        if self.open_cm is not None:
            cm, self.open_cm = self.open_cm, None
            cm.__exit__(None, None, None)
        if self.token is not None:
            token, self.token = self.token, None
            self.timer.end(token, self.work)


class _BackwardMark(torch.autograd.Function):
    """Identity. Its backward calls ``mark()``: on the input it closes the scope (the
    layer's backward compute is done), on the output it opens it (it begins)."""

    @staticmethod
    def forward(ctx, x, mark):
        ctx.mark = mark
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.mark()
        return grad, None


def straggled(compute, x: torch.Tensor, timer=None, work: float = 0.0) -> torch.Tensor:
    """``compute(x)`` inside the layer's compute region (:func:`compute_scope`), in the forward
    and, when ``x`` needs a gradient, in the backward too (from the output's gradient arriving
    to the input's leaving), so an emulated slow rank is slow at all of its compute, not only
    the forward's third, and the timer sees both. ``work`` is counted once, in the forward."""
    if not (torch.is_grad_enabled() and x.requires_grad) and _idle(timer):
        return compute(x)  # no region to enter, forward or backward
    live = dist.is_available() and dist.is_initialized()
    backward = live and torch.is_grad_enabled() and x.requires_grad
    scope = _Region(x.device, timer) if backward else None
    if scope is not None:
        x = _BackwardMark.apply(x, scope.close)
    with compute_scope(x.device, timer, work):
        y = compute(x)
    return y if scope is None else _BackwardMark.apply(y, scope.open)


class _PieceRegion:
    """A layer's compute region entered once per piece of a fused operator
    (``plait.ops.pieces``): straggler emulation and timing around each local GEMM only."""

    def __init__(self, device, timer):
        self.device, self.timer = device, timer

    def piece(self):
        return compute_scope(self.device, self.timer)



def pieces(compute, x: torch.Tensor, timer=None, work: float = 0.0) -> torch.Tensor:
    """``compute(x)``, a fused operator, with the layer's compute region around each of its
    local pieces, forward and backward, and not around its waits for other ranks: a fast
    rank waiting on a slow one is not measured (or emulated) slow. ``work`` counted once."""
    from ..ops.pieces import compute_region, current_region

    if timer is not None:
        timer.count(work)
    region = None if _idle(timer) else _PieceRegion(x.device, timer)
    if region is None and current_region() is None:  # nothing to enter (a decoding step)
        return compute(x)
    with compute_region(region):
        return compute(x)


def resolve_plan(plan: ShardPlan | None, units: int, info: GroupInfo, *, what: str, layer: str,
                 allow_empty: bool = False) -> ShardPlan:
    """The given plan checked against ``units`` on this group, or the even one."""
    if plan is None:
        plan = ShardPlan.even(units, info.world)
    elif not isinstance(plan, ShardPlan):
        raise TypeError(f"{layer}: plan must be a plait.plan.ShardPlan, got {type(plan).__name__}")
    return plan.check(units, info.world, what=what, layer=layer, allow_empty=allow_empty)


def check_full(layer: str, name: str, tensor: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """A full (unsharded) weight handed to a layer must have the layer's full shape."""
    if tensor is None:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{layer}: {name} must be a tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{layer}: {name} has shape {tuple(tensor.shape)}, but the layer's full "
                         f"{name} is {tuple(shape)}")


def shard_of(full: torch.Tensor, plan: ShardPlan, rank: int, dim: int = 0, *, blocks: int = 1,
             unit: int = 1) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` along ``dim``, a copy.

    ``dim`` holds ``blocks`` equal blocks (a fused QKV weight holds 3), each split
    by ``plan`` in units of ``unit`` elements; the slices of the blocks are
    concatenated in block order.
    """
    dim = dim % full.dim()
    length = full.shape[dim]
    assert length == blocks * plan.total * unit, (tuple(full.shape), dim, blocks, plan, unit)
    per_block = plan.total * unit
    cut = plan.slice_of(rank)
    parts = [full.narrow(dim, b * per_block + cut.start * unit, (cut.stop - cut.start) * unit)
             for b in range(blocks)]
    return torch.cat(parts, dim=dim).contiguous()


def unshard(local: torch.Tensor, plan: ShardPlan, group=None, dim: int = 0, *, blocks: int = 1,
            unit: int = 1) -> torch.Tensor:
    """The full tensor from every rank's ``shard_of`` slice (a collective: every rank calls it)."""
    from ..ops.regions import _all_gather

    dim = dim % local.dim()
    if plan.world == 1:
        return local.detach().clone()
    shape = list(local.shape)
    # [.., blocks, n_r, ..]: gather the block slices of every rank along the split dim
    split = shape[:dim] + [blocks, shape[dim] // blocks] + shape[dim + 1:]
    with torch.no_grad():
        gathered = _all_gather(local.detach().reshape(split), dim + 1,
                               [s * unit for s in plan.sizes], group)
    full = shape[:dim] + [blocks * plan.total * unit] + shape[dim + 1:]
    return gathered.reshape(full)


def replace_data(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """``param.data = value`` where ``value`` may have another shape (a new plan).

    A parameter's gradient accumulator caches its shape and lives as long as any graph
    that used it (the last step's ``loss`` keeps one alive), and ``set_data`` drops it
    only on a change of type or device, so the next backward would refuse the new shape.
    Passing through an empty tensor of another dtype drops it; it costs no copy.
    """
    other = torch.float16 if param.dtype != torch.float16 else torch.float32
    param.data = torch.empty(0, dtype=other, device=value.device)
    param.data = value


def mark_partial_grad(param: torch.nn.Parameter, group=None) -> None:
    """Sum ``param``'s gradient over the group as it is computed.

    For a replicated parameter that each rank uses on its own share of the data
    (a LayerNorm inside a sequence-parallel region, an MoE router, a
    data-parallel MLP): each rank's gradient is a partial sum. The hook sees
    each backward's fresh gradient before accumulation, so gradient
    accumulation stays right; it costs one all_reduce per parameter per backward.
    """
    if is_partial(param) or GroupInfo(group).world == 1:
        return

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        from ..ops.context import transport_of

        grad = grad.contiguous().clone()
        transport_of(group).all_reduce(grad)
        return grad

    param.register_hook(all_reduce)
    mark_partial(param)

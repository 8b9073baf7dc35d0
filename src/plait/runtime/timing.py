"""Wall-clock timing that means the same on CPU and CUDA, agreed across ranks."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["sync", "time_once", "time_repeated", "time_interleaved", "balanced_orders",
           "balanced_round", "agreed_max", "median"]


def sync(device: torch.device | None = None) -> None:
    """Wait for queued device work, so a clock read means the work is done."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def time_once(fn: Callable[[], object], device: torch.device | None = None,
              barrier: bool = True, group=None) -> float:
    """Seconds one call of ``fn`` takes on this rank, started together with the others."""
    sync(device)
    if barrier and dist.is_initialized():
        dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def agreed_max(values: Sequence[float], group=None, device: torch.device | None = None) -> list[float]:
    """Element-wise max over ranks: an iteration takes as long as its slowest rank.
    ``device``: where the small tensor lives (NCCL moves only CUDA tensors)."""
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def time_repeated(fn: Callable[[], object], iters: int, device: torch.device | None = None,
                  group=None) -> list[float]:
    """Per-iteration times, each the max over ranks, after the caller's warm-up."""
    own = [time_once(fn, device, group=group) for _ in range(iters)]
    return agreed_max(own, group, device)


def balanced_orders(n: int) -> list[list[int]]:
    """A Williams design: orders of ``range(n)`` in which each index takes each place
    equally often and follows each other index equally often (``n`` orders for even ``n``,
    ``2n`` for odd, a forward order and its reverse in turn). Turning one order by one
    place each round would keep every index's neighbours: it would always follow the same one."""
    base = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    forward = [[(b + i) % n for b in base] for i in range(n)]
    if n % 2 == 0 or n == 1:
        return forward
    return [order for row in forward for order in (row, row[::-1])]


def balanced_round(items: Sequence, i: int) -> list:
    """``items`` in round ``i``'s order of :func:`balanced_orders` (the design repeats)."""
    orders = balanced_orders(len(items))
    return [items[j] for j in orders[i % len(orders)]] if items else []


def time_interleaved(fns: dict, rounds: int, device: torch.device | None = None,
                     group=None) -> dict:
    """Each function's times (each the max over ranks) over ``rounds`` rounds, every
    function timed once a round, after the caller's warm-up. Interleaved, a slow stretch
    of a shared machine lands on one round of every function, not on every call of some;
    and the rounds follow :func:`balanced_orders`, so each function runs after a different
    one each round (whatever one call leaves behind, the next inherits) and in each place."""
    names = list(fns)
    own = {name: [] for name in names}
    for i in range(rounds):
        for name in balanced_round(names, i):
            own[name].append(time_once(fns[name], device, group=group))
    slowest = agreed_max([t for name in names for t in own[name]], group, device)
    return {name: slowest[j * rounds:(j + 1) * rounds] for j, name in enumerate(names)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)

"""Wall-clock timing that means the same on CPU and CUDA, agreed across ranks."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["sync", "time_once", "time_repeated", "time_interleaved", "agreed_max", "median"]


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


def time_interleaved(fns: dict, rounds: int, device: torch.device | None = None,
                     group=None) -> dict:
    """Each function's times (each the max over ranks) over ``rounds`` rounds, every
    function timed once a round, after the caller's warm-up. Interleaved, a slow stretch
    of a shared machine lands on one round of every function, not on every call of some;
    and the order turns by one each round, so no function always follows the same one
    (whatever one call leaves behind, the next inherits)."""
    names = list(fns)
    own = {name: [] for name in names}
    for i in range(rounds):
        turn = i % len(names) if names else 0
        for name in names[turn:] + names[:turn]:
            own[name].append(time_once(fns[name], device, group=group))
    slowest = agreed_max([t for name in names for t in own[name]], group, device)
    return {name: slowest[j * rounds:(j + 1) * rounds] for j, name in enumerate(names)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)

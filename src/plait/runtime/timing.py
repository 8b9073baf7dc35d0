"""Wall-clock timing that means the same on CPU and CUDA, agreed across ranks."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["sync", "time_once", "time_repeated", "agreed_max", "median"]


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


def median(values: Sequence[float]) -> float:
    return statistics.median(values)

"""How an operator's output is cut into pieces, the compute region each piece is timed in,
and the checks every operator shares.

The compute region: a tensor-parallel layer wants two things around its own compute and nothing
else: the straggler emulation (a slow rank is slow at compute, not at waiting)
and the speed monitor's timer (work per second of compute). Around a whole
fused operator both would also count the time spent waiting for the other
ranks' pieces, so a fast rank waiting on a slow one would look slow too.

So a layer enters ``compute_region(region)`` around the operator call, and the
operators wrap each local GEMM piece in ``piece()``, which opens
``region.piece()`` (a context manager) or nothing when no region is set. An
operator's autograd Function keeps the region of its forward
(``current_region()``) and re-enters it in its backward, which autograd runs
outside the layer's ``with``.
"""

from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Iterator, Sequence

import torch

from ..perf.pieces import offsets, split, tapered  # pure: the cost model cuts pieces the same way

__all__ = ["split", "row_parts", "as_rows", "tapered", "offsets", "even_sizes", "check_sizes",
           "check_float", "FLOATS", "compute_region", "current_region", "piece"]

FLOATS = frozenset((torch.float32, torch.float64, torch.bfloat16, torch.float16))
"""The dtypes the fused operators take."""


def row_parts(total: int, pieces: int) -> list[int]:
    """``total`` rows in exactly ``pieces`` parts (trailing ones empty when total < pieces)."""
    sizes = split(total, pieces)
    return sizes + [0] * (pieces - len(sizes))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] (a view where it can be): ``reshape(-1, K)`` refuses a tensor
    with no elements (an empty share: no rows, or K_r = 0), this does not."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def even_sizes(total: int, world: int) -> list[int]:
    """``total`` in ``world`` near-equal shares, larger first: ``even_sizes(2, 3) == [1, 1, 0]``
    (a share may be empty; every operator and layer takes one)."""
    return row_parts(total, world)


def check_sizes(op: str, what: str, sizes: Sequence[int], world: int, local: int, rank: int) -> None:
    """A per-rank size list must have one non-negative entry per rank and match this rank's tensor."""
    if len(sizes) != world:
        raise ValueError(f"{op}: {what} {list(sizes)} has {len(sizes)} entries for {world} ranks")
    if any(int(s) < 0 for s in sizes):
        raise ValueError(f"{op}: {what} {list(sizes)} has a negative size")
    if int(sizes[rank]) != local:
        raise ValueError(f"{op}: {what} {list(sizes)} give rank {rank} {sizes[rank]}, "
                         f"but its tensor has {local}")


def check_float(op: str, *tensors: torch.Tensor) -> torch.dtype:
    first = tensors[0]
    dtype, device = first.dtype, first.device
    if dtype in FLOATS and all(t.dtype == dtype and t.device == device
                                    for t in tensors[1:]):
        return dtype  # the common case, every call: one pass, no sets
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise TypeError(f"{op}: tensors must share one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    if dtype not in FLOATS:
        raise TypeError(f"{op}: dtype {dtype} is not supported; use float32, float64, bfloat16 or float16")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{op}: tensors are on different devices {sorted(map(str, devices))}")
    return dtype


# --- the compute region ----------------------------------------------------------
_REGION: ContextVar = ContextVar("plait_compute_region", default=None)


@contextlib.contextmanager
def compute_region(region) -> Iterator[None]:
    """Make ``region`` (an object with ``piece()``, or None) the one ``piece()`` enters."""
    token = _REGION.set(region)
    try:
        yield
    finally:
        _REGION.reset(token)


def current_region():
    return _REGION.get()


def piece():
    """The current region's piece context, or a no-op."""
    region = _REGION.get()
    return contextlib.nullcontext() if region is None else region.piece()

"""The caller's compute region, entered piece by piece inside a fused operator.

A tensor-parallel layer wants two things around its own compute and nothing
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
from contextvars import ContextVar
from typing import Iterator

__all__ = ["compute_region", "current_region", "piece"]

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

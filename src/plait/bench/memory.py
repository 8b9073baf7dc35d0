"""Peak tensor memory of one call, on any device: every tensor an op creates is counted
while it lives. Used by the benchmarks to show that a fused operator's pieces cost no
more memory than the plain path (``peak_bytes(fn)``), never inside timed runs."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["peak_bytes"]


class _PeakTensorMemory(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view, an in-place or an out= op: no new memory
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor)
        return out

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self.seen:
            return  # an out= argument, or a tensor already counted
        self.seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


def peak_bytes(fn: Callable[[], Any]) -> int:
    """Most bytes of tensors created by ``fn`` alive at once (its result included)."""
    mode = _PeakTensorMemory()
    with mode:
        result = fn()
    del result
    return mode.peak

"""The scale-up transport on CUDA: torch's own symmetric memory (imported only here, only on CUDA).

A group whose ranks share a host and run NCCL all-reduces through
``torch.distributed._symmetric_memory``: one buffer per group, made with
``symm_mem.empty`` and ``symm_mem.rendezvous`` (every rank maps every peer's; torch's
signal pads order the peers), and torch's kernels ``symm_mem.one_shot_all_reduce_out``
(up to ``ONE_SHOT_BYTES``) and ``two_shot_all_reduce_`` (above). Both run on the current
CUDA stream, ordered with the kernels around them, with no host synchronisation (a CUDA
graph can capture them); the handle an ``async_op`` call returns is complete in stream
order. Gathers and all-to-alls stay on NCCL. plait writes no IPC of its own on CUDA.

Not measured in this repository's runs: the machines here have no GPU, and one lent GPU
cannot host a group of two ranks. ``scripts/device_check.py`` runs what one GPU can.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from .base import Choice, DistTransport, Done

__all__ = ["SymmMemTransport", "available", "ONE_SHOT_BYTES"]

ONE_SHOT_BYTES = 256 * 1024
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> str | None:
    """None where torch's symmetric memory can run here; else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as err:
        return f"torch has no symmetric memory ({err})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return "torch's symmetric memory has no one_shot_all_reduce_out"
    return None


class SymmMemTransport(DistTransport):
    """All-reduces through torch's symmetric memory; the rest through NCCL (the base)."""

    def __init__(self, group, choice: Choice, *, capacity: int = 64 << 20):
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
        super().__init__(group, choice)
        self.name = "symm_mem"
        pg = group or dist.group.WORLD
        self.group_name = pg.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(self.group_name)
        device = torch.device("cuda", torch.cuda.current_device())
        self.capacity = capacity
        self.buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, pg)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.dtype not in _DTYPES or nbytes > self.capacity or not tensor.is_cuda:
            return super().all_reduce(tensor, async_op)
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        staged = self.buffer[:nbytes].view(tensor.dtype)
        staged.copy_(flat)
        if nbytes <= ONE_SHOT_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
        return Done() if async_op else None

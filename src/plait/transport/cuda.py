"""The scale-up transport on CUDA: torch's own symmetric memory (imported only here, only on CUDA).

A group whose ranks share a host and run NCCL all-reduces through
``torch.distributed._symmetric_memory``: one buffer per group, made with
``symm_mem.empty`` and ``symm_mem.rendezvous`` (every rank maps every peer's; torch's
signal pads order the peers), and torch's kernels ``symm_mem.one_shot_all_reduce_out``
(up to ``ONE_SHOT_BYTES``) and ``two_shot_all_reduce_`` (above). Both run on the current
CUDA stream, ordered with the kernels around them, with no host synchronisation (a CUDA
graph can capture them); the handle an ``async_op`` call returns is complete in stream
order. Gathers and all-to-alls stay on NCCL. plait writes no IPC of its own on CUDA.

What goes to NCCL instead, call by call (the same on every rank: it follows from the
tensor alone): a dtype torch's kernels do not take (they take float32 and bfloat16, not
float16), a size that is not a multiple of 4 bytes (an odd-length bf16 tensor), a tensor
larger than the buffer. Set-up that fails on any rank (no P2P, IPC blocked in a
container) falls back to NCCL on every rank, with the reason.

Checks: the first call of each (dtype, numel) is agreed across ranks (one small gather:
a host sync once per signature, none after), so ranks whose sizes differ raise instead
of spinning in torch's signal pads or reading past a peer's term. Ranks that agreed on two
signatures and then call them in different orders are not caught (nor are they by NCCL).
The buffer is shared by every stream: a call on another stream than the last one's waits
for it on the GPU (an event), so two streams never stage into it at once.

Not measured in this repository's runs: the machines here have no GPU, and one lent GPU
cannot host a group of two ranks. ``scripts/device_check.py`` runs what one GPU can.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from .base import Choice, DistTransport, Done

__all__ = ["SymmMemTransport", "available", "symm_mem_path", "ONE_SHOT_BYTES"]

ONE_SHOT_BYTES = 256 * 1024
_DTYPES = (torch.float32, torch.bfloat16)  # what torch's symmetric-memory kernels dispatch


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


def symm_mem_path(dtype: torch.dtype, nbytes: int, capacity: int) -> str | None:
    """None where an all-reduce of ``nbytes`` of ``dtype`` goes through symmetric memory;
    else why NCCL takes it (every rank alike: it follows from the tensor)."""
    if dtype not in _DTYPES:
        return f"{dtype} (torch's kernels take float32 and bfloat16)"
    if nbytes % 4:
        return f"{nbytes} bytes, not a multiple of 4"
    if nbytes > capacity:
        return f"{nbytes} bytes, more than the {capacity}-byte buffer"
    return None


class SymmMemTransport(DistTransport):
    """All-reduces through torch's symmetric memory; the rest through NCCL (the base).
    Raises :class:`SymmMemUnavailable` on every rank where set-up failed on any."""

    def __init__(self, group, choice: Choice, *, capacity: int = 64 << 20):
        symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
        super().__init__(group, choice)
        self.name = "symm_mem"
        pg = group or dist.group.WORLD
        self.group_name = pg.group_name
        self.capacity = capacity
        device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = self.handle = None
        why = None
        try:
            self.buffer = symm_mem.empty(capacity, dtype=torch.uint8, device=device)
        except Exception as err:  # noqa: BLE001 - agreed below, then NCCL
            why = f"symm_mem.empty: {err}"
        _agree(group, why)
        try:
            self.handle = symm_mem.rendezvous(self.buffer, pg)
        except Exception as err:  # noqa: BLE001 - agreed below, then NCCL
            why = f"symm_mem.rendezvous: {err}"
        _agree(group, why)
        self._agreed: set[tuple] = set()  # (dtype, numel) every rank has called alike
        self._last_stream = None
        self._used = torch.cuda.Event()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, check=None):
        self._uncarried(check)
        nbytes = tensor.numel() * tensor.element_size()
        if not tensor.is_cuda or symm_mem_path(tensor.dtype, nbytes, self.capacity):
            return super().all_reduce(tensor, async_op)
        signature = (tensor.dtype, tensor.numel())
        if signature not in self._agreed:
            self._agree_signature(signature)
        stream = torch.cuda.current_stream()
        if self._last_stream is not None and stream != self._last_stream:
            stream.wait_event(self._used)  # the buffer's last user, on the GPU
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1)
        staged = self.buffer[:nbytes].view(tensor.dtype)
        staged.copy_(flat)
        if nbytes <= ONE_SHOT_BYTES:
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, flat)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            flat.copy_(staged)
        self._used.record(stream)
        self._last_stream = stream
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view(tensor.shape))
        return Done() if async_op else None

    def _agree_signature(self, signature: tuple) -> None:
        """Every rank's first call of a new (dtype, numel): the same on every rank, or a
        ValueError on every rank naming each one's."""
        every: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, (str(signature[0]), signature[1]), group=self.group)
        if len(set(every)) != 1:
            raise ValueError(f"all_reduce: ranks disagree on the tensor: " + ", ".join(
                f"rank {r} has {dtype} × {numel}" for r, (dtype, numel) in enumerate(every)))
        self._agreed.add(signature)


class SymmMemUnavailable(RuntimeError):
    """Symmetric memory could not be set up on some rank (raised on every rank alike)."""


def _agree(group, why: str | None) -> None:
    """Raise :class:`SymmMemUnavailable` on every rank where any rank has a ``why``."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, why, group=group)
    failed = [(r, w) for r, w in enumerate(every) if w is not None]
    if failed:
        raise SymmMemUnavailable("; ".join(f"rank {r}: {w}" for r, w in failed))

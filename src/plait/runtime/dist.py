"""Process-group set-up: from a torchrun environment, or explicitly.

torch.distributed is the engine; this module only picks the backend, applies
a timeout to every collective, and keeps the facts of the group in one
validated object (:class:`Topology`).
"""

from __future__ import annotations

import atexit
import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .priority import prioritize_group

__all__ = [
    "Topology",
    "DEFAULT_TIMEOUT_S",
    "default_backend",
    "init_from_env",
    "init_explicit",
    "shutdown",
    "topology",
]

log = logging.getLogger("plait.runtime")

DEFAULT_TIMEOUT_S = 60.0
"""Every collective raises after this long instead of hanging (PLAIT_TIMEOUT_S overrides)."""


@dataclass(frozen=True)
class Topology:
    """Who this process is in the default group, and on which device it computes."""

    rank: int
    world_size: int
    backend: str
    device: torch.device
    timeout_s: float

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s} s")

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def default_backend() -> str:
    """nccl when this process can see a CUDA device, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _timeout_s(timeout_s: float | None) -> float:
    if timeout_s is not None:
        return float(timeout_s)
    return float(os.environ.get("PLAIT_TIMEOUT_S", DEFAULT_TIMEOUT_S))


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_explicit(*, rank: int, world_size: int, backend: str | None = None,
                  store: dist.Store | None = None, init_method: str | None = None,
                  local_rank: int | None = None, timeout_s: float | None = None) -> Topology:
    """Join a group of ``world_size`` ranks as ``rank``; returns the :class:`Topology`."""
    backend = backend or default_backend()
    topo = Topology(rank=rank, world_size=world_size, backend=backend,
                    device=torch.device("cpu"), timeout_s=_timeout_s(timeout_s))
    device = _device(backend, rank if local_rank is None else local_rank)
    if not dist.is_initialized():
        kwargs = {"store": store} if store is not None else {"init_method": init_method or "env://"}
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=topo.timeout_s), **kwargs)
        # a script that ends without destroy_process_group (most torchrun scripts) otherwise
        # tears gloo down during interpreter exit, which now and then aborts the process
        # ("terminate called without an active exception", exit -6)
        atexit.register(shutdown)
        prioritize_group()  # gloo's transfers ahead of compute for a core (runtime.priority)
    return Topology(rank=rank, world_size=world_size, backend=backend,
                    device=device, timeout_s=topo.timeout_s)


def init_from_env(*, backend: str | None = None, timeout_s: float | None = None) -> Topology:
    """Initialise from the variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    Without them (plain ``python script.py``) this is a world of one on loopback.
    """
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    missing = [k for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"torchrun environment is incomplete: {', '.join(missing)} not set")
    return init_explicit(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                         local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                         backend=backend, timeout_s=timeout_s)


def topology() -> Topology:
    """The :class:`Topology` of the initialised default group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call plait.runtime.init_from_env()")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    return Topology(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=backend,
                    device=_device(backend, local_rank), timeout_s=_timeout_s(None))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

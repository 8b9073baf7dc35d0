"""Which transport a group's collectives take, chosen once per group by every rank together.

- ``"shm"``: the group's ranks share one host (the same boot, and the same network
  namespace: two emulated hosts on one machine are two hosts):
  :class:`~.collectives.ShmTransport`.
- ``"gloo"`` (or NCCL on CUDA): ``torch.distributed`` itself: :class:`DistTransport`.
- ``"auto"`` (the default; ``PLAIT_TRANSPORT`` or ``--transport`` set another): shared
  memory where every rank of the group is on one host, it is supported here, ``/dev/shm``
  has room for the group's segments, and set-up finds that the ranks share it (they may
  share a network but not ``/dev/shm``: Docker's ``--network=host`` without
  ``--ipc=host``); else ``torch.distributed``. The ranks agree on it (one all_gather of
  where each one runs, and set-up's own agreed verdict), and the choice and its reason
  are kept (``Choice``) for ``plait.parallel.applied``, the benchmarks and ``-v``.
  ``"shm"`` asked for where it cannot run is refused on every rank in one line that says
  what to change.

Both transports answer the same calls, each on contiguous tensors and in rank order:
``all_reduce(t)`` (in place), ``summed(t)`` (the sum as a new tensor),
``all_gather(out, piece, rows)``, ``reduce_scatter(out, t,
rows)``, ``all_to_all(out, send, out_rows, in_rows)``, and ``gather_meta`` (the operators'
cross-rank check). ``async_op=True`` returns a handle whose ``wait()`` completes the call;
shared memory has no engine of its own on a CPU (the rank's own thread moves the bytes),
so there the call is done when it returns and the handle is already complete.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

from .asked import TRANSPORTS, wanted
from .base import Choice, DistTransport
from .collectives import ShmTransport

__all__ = ["TRANSPORTS", "Choice", "choose", "DistTransport", "ShmTransport", "wanted"]

log = logging.getLogger("plait.transport")


def choose(group, requested: str | None = None, *, timeout_s: float = 60.0):
    """The transport of ``group``: every rank calls it (one all_gather), and all get the same
    choice. A ``"shm"`` asked for where it cannot run is a ValueError on every rank.

    A group across hosts with two or more of its ranks on some host takes shared memory
    inside each host and gloo between hosts for its all-reduces
    (:class:`~plait.transport.hier.HierTransport`), gloo for the rest."""
    from .shm import ShmUnavailable, host_id, shm_free_bytes, supported

    requested = requested or wanted()
    backend = dist.get_backend(group)
    world = dist.get_world_size(group)
    if backend == "nccl":
        return _choose_cuda(group, requested, world)
    why_not = supported() if backend == "gloo" else f"the group runs {backend}"
    every: list = [None] * world
    dist.all_gather_object(every, (host_id(), why_not, shm_free_bytes()), group=group)
    hosts = [h for h, _, _ in every]
    blocked = next((w for _, w, _ in every if w is not None), None)
    shared = max(hosts.count(h) for h in set(hosts))
    if world == 1:
        blocked = "one rank: nothing to move"
    elif blocked is None and shared == 1:
        blocked = f"each of the group's {world} ranks is on a host of its own"
    elif blocked is None:
        blocked = _room(every)
    if requested == "shm" and blocked is not None:
        raise ValueError(f"--transport shm: {blocked}")
    if requested == "gloo" or blocked is not None:
        reason = "asked for" if requested == "gloo" else f"auto: {blocked}"
        return DistTransport(group, Choice(backend, reason),
                             one_host=world > 1 and len(set(hosts)) == 1)
    if len(set(hosts)) > 1:
        from .hier import HierTransport

        why = (f"{'asked for' if requested == 'shm' else 'auto'}: {world} ranks on "
               f"{len(set(hosts))} hosts: shared memory inside each host, gloo between hosts "
               "(all-reduces); gloo for the other collectives")
        return HierTransport(group, Choice("shm+gloo", why), hosts, timeout_s=timeout_s)
    try:
        reason = "asked for" if requested == "shm" else \
            f"auto: all {world} ranks on one host"
        return ShmTransport(group, Choice("shm", reason), timeout_s=timeout_s)
    except ShmUnavailable as err:  # set-up's verdict: the same on every rank
        if requested == "shm":
            raise ValueError(f"--transport shm: {err}") from None
        return DistTransport(group, Choice(backend, f"auto: {err}"), one_host=True)


def _room(every: list) -> str | None:
    """Why ``/dev/shm`` cannot hold the segments of the ranks that share it, or None
    (``every``: each rank's host, why-not and free bytes; a host's ranks share one)."""
    from .collectives import default_capacity
    from .shm import segment_bytes

    hosts = [h for h, _, _ in every]
    for host in dict.fromkeys(hosts):
        ranks = hosts.count(host)
        free = min((f for h, _, f in every if h == host and f is not None), default=None)
        # a host of several ranks: each makes one segment for its group on the host
        need = ranks * segment_bytes(ranks, default_capacity(ranks))
        if free is not None and ranks > 1 and free < need:
            return (f"/dev/shm has {free / 2**20:.2f} MiB free, {ranks} ranks need "
                    f"{need / 2**20:.2f} MiB: give it more (docker --shm-size, or --ipc=host)")
    return None


def _choose_cuda(group, requested: str, world: int):
    """NCCL groups: torch's symmetric memory for all-reduces where every rank shares a host
    (``plait.transport.cuda``), NCCL otherwise and for the rest."""
    from .cuda import SymmMemTransport, SymmMemUnavailable, available
    from .shm import host_id

    every: list = [None] * world
    dist.all_gather_object(every, (host_id(), available()), group=group)
    blocked = next((w for _, w in every if w is not None), None)
    if blocked is None and len({h for h, _ in every}) > 1:
        blocked = f"the group's {world} ranks are on {len({h for h, _ in every})} hosts"
    if world == 1:
        blocked = "one rank: nothing to move"
    if requested == "shm" and blocked is not None:
        raise ValueError(f"--transport shm: {blocked}")
    if requested == "gloo" or blocked is not None:
        reason = "asked for" if requested == "gloo" else f"auto: {blocked}"
        return DistTransport(group, Choice("nccl", reason))
    asked = "asked for" if requested == "shm" else "auto"
    try:
        return SymmMemTransport(group, Choice("symm_mem", (
            f"{asked}: all {world} ranks on one host: torch's symmetric memory for "
            "all-reduces, NCCL for the rest")))
    except SymmMemUnavailable as err:  # set-up failed on some rank: every rank alike
        if requested == "shm":
            raise ValueError(f"--transport shm: torch's symmetric memory: {err}") from None
        return DistTransport(group, Choice("nccl", f"auto: torch's symmetric memory: {err}"))

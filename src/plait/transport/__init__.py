"""How bytes move between ranks: shared memory inside a host, torch.distributed between hosts.

- :mod:`.shm`: every rank of a group on one host maps every peer's segment; a flag per
  slot, an epoch in it, says a piece has landed (``ShmSegments``).
- :mod:`.calls`: one collective call on it: its epoch, the cross-rank check carried in its
  header, its pieces' flags (``Call``).
- :mod:`.collectives`: all_reduce, all_gather, reduce_scatter, all_to_all on it
  (``ShmGroup``).

Names load on first use (PEP 562): the command line reads ``transport.shm``'s sizes
without importing torch.
"""

from ..runtime.lazy import exports

_WHERE = {
    "calls": ("Call", "Header"),
    "collectives": ("GroupBroken", "ShmGroup"),
    "shm": ("PeerDied", "PeerFailed", "ShmSegments", "ShmUnavailable", "remove_stale",
            "supported"),
}
__getattr__, __all__ = exports(__name__, _WHERE)

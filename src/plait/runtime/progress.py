"""How far each launched rank has got, in memory the launcher reads: its watchdog's input.

A rank marks progress each time it enters an operator (plait's operators do, at
their cross-rank check) or reports a step; the launcher, which shares none of
the ranks' scheduling, stops the run when no rank has marked anything for the
collective timeout plus a grace, and names the rank that fell behind and the
operator it last entered. Outside ``launch`` (torchrun, ``plait cluster run``)
marking is a no-op that costs one attribute look-up.
"""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import dataclass

from . import current

__all__ = ["ProgressBoard", "mark"]

_NAME_BYTES = 48  # an operator's name, truncated: enough for "matmul_reduce_scatter.backward"


@dataclass
class ProgressBoard:
    """One counter and one operator name per rank, in shared memory (no locks: each rank
    writes only its own slot, the launcher only reads)."""

    counts: object  # RawArray('q', world)
    names: object   # RawArray('c', world * _NAME_BYTES)

    @classmethod
    def new(cls, ctx: mp.context.BaseContext, world_size: int) -> "ProgressBoard":
        return cls(ctx.RawArray("q", world_size), ctx.RawArray("c", world_size * _NAME_BYTES))

    def mark(self, rank: int, op: str | None = None) -> None:
        self.counts[rank] += 1
        if op is not None:
            raw = op.encode()[:_NAME_BYTES - 1]
            start = rank * _NAME_BYTES
            self.names[start:start + len(raw) + 1] = raw + b"\0"

    def count(self, rank: int) -> int:
        return self.counts[rank]

    def last_op(self, rank: int) -> str | None:
        start = rank * _NAME_BYTES
        raw = bytes(self.names[start:start + _NAME_BYTES]).split(b"\0", 1)[0]
        return raw.decode(errors="replace") or None


def mark(op: str | None = None) -> None:
    """This rank made progress (entered ``op``, or a step when None)."""
    ctx = current.get()
    if ctx is not None and ctx.progress is not None:
        ctx.progress.mark(ctx.topology.rank, op)

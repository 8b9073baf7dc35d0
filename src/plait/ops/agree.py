"""What every rank must agree on before data moves: shapes, and each rank's verdict on its input.

One small all_gather per call carries every rank's integers (dtype code, dims,
per-rank sizes, ``chunks``, whether a backward collective will follow: all that
fixes the wire schedule, forward and backward) and whether its own input passed
its local checks, so a bad input on any rank raises the same error on every
rank, before any data collective, instead of leaving the peers inside a
collective it never joins (gloo then aborts on a size check, or waits out its
timeout).
It is never cached: a cache per rank would let one rank skip a gather its
peers join, the moment one rank's shapes change alone (the balancer does that).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from ..runtime.progress import mark
from ..transport.base import dist_all_gather
from ..transport.calls import dtype_code, dtype_named

__all__ = ["Check", "check_chunks", "chunks_code", "check_same", "dtype_code",
           "gather_checked", "start_gather_checked", "meta_device", "raise_together"]


class Check:
    """An operator's cross-rank check, typed: a subclass is a frozen dataclass of integers,
    one field each, in the order they cross ranks (a field named in ``PER_RANK`` holds one
    integer per rank, a tuple). ``row()`` is what this rank sends; ``from_rows`` reads
    every rank's back; ``AGREED`` names the fields every rank must share (the others may
    differ: a rank's own shard); ``LABELS`` gives a field's name in an error where it is
    not the field's own."""

    AGREED: ClassVar[tuple[str, ...]] = ()
    PER_RANK: ClassVar[frozenset] = frozenset()
    LABELS: ClassVar[dict] = {}

    def row(self) -> tuple[int, ...]:
        out: list[int] = []
        for f in fields(self):
            value = getattr(self, f.name)
            out.extend(value) if f.name in self.PER_RANK else out.append(int(value))
        return tuple(out)

    @classmethod
    def width(cls, world: int) -> int:
        """How many integers a row holds on ``world`` ranks (0 where no field is per rank)."""
        return sum(world if f.name in cls.PER_RANK else 1 for f in fields(cls))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The fields as an error names them."""
        return tuple(cls.LABELS.get(f.name, f.name) for f in fields(cls))

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]]) -> list:
        """Every rank's check, from every rank's row (as gathered, in rank order)."""
        world, out = len(rows), []
        for row in rows:
            values, at = [], 0
            for f in fields(cls):
                if f.name in cls.PER_RANK:
                    values.append(tuple(int(v) for v in row[at:at + world]))
                    at += world
                else:
                    values.append(int(row[at]))
                    at += 1
            out.append(cls(*values))
        return out

    @classmethod
    def agree(cls, op: str, rows: Sequence, names: Sequence[str] | None = None,
              labels: dict | None = None) -> None:
        """Raise (on every rank alike: ``rows`` are every rank's, as gathered, or their
        checks) where the fields ``names`` (default ``AGREED``) differ between ranks, named
        as ``labels`` (over ``LABELS``) say. Reads only those fields' places, so a row cut
        short after them is judged too."""
        names = cls.AGREED if names is None else tuple(names)
        labels = {**cls.LABELS, **(labels or {})}
        rows = [r.row() if isinstance(r, Check) else r for r in rows]
        world, where, at = len(rows), {}, 0
        for f in fields(cls):
            span = world if f.name in cls.PER_RANK else 1
            where[f.name] = (at, span, f.name in cls.PER_RANK)
            at += span

        def value(row, name):
            start, span, per_rank = where[name]
            return tuple(int(v) for v in row[start:start + span]) if per_rank else row[start]
        check_same(op, [labels.get(n, n) for n in names],
                   [tuple(value(row, n) for n in names) for row in rows])


def chunks_code(chunks) -> int:
    """``chunks`` as one integer for the cross-rank check: 0 for "auto"."""
    return 0 if chunks == "auto" else chunks


def check_same(op: str, names: Sequence[str], values: Sequence[Sequence]) -> None:
    """Raise when the ranks' ``values`` (one tuple per rank, a field per name) differ.

    ``values`` come from one gather, so every rank raises the same ValueError, naming
    the fields that differ and what each rank has (a dtype by name, chunks 0 as 'auto').
    """
    first = values[0]
    differ = [i for i in range(len(names)) if any(v[i] != first[i] for v in values)]
    if not differ:
        return

    def shown(v) -> str:
        parts = [_shown(names[i], v[i]) for i in differ]
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    label = names[differ[0]] if len(differ) == 1 else \
        "(" + ", ".join(names[i] for i in differ) + ")"
    ranks = [0] + [r for r, v in enumerate(values) if shown(v) != shown(first)]
    told = [f"rank {r} has {shown(values[r])}" for r in ranks[:4]]
    more = f" (and {len(ranks) - 4} more ranks)" if len(ranks) > 4 else ""
    raise ValueError(f"{op}: ranks disagree on {label}: " + ", ".join(told) + more)


def _shown(name: str, value) -> str:
    if name == "dtype":
        return str(dtype_named(value))
    if name == "chunks":
        return "'auto'" if value == 0 else str(value)
    if "grad" in name:
        return str(bool(value))
    return str(list(value)) if isinstance(value, tuple) else repr(value)


def check_chunks(op: str, chunks) -> None:
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"{op}: chunks must be 'auto' or a positive integer, got {chunks!r}")


def meta_device(group) -> torch.device:
    """Where the small check tensors live: NCCL only moves CUDA tensors."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_checked(op: str, group, problem: Exception | None, row: Sequence[int],
                   width: int) -> list[list[int]]:
    """Every rank's ``row`` (``width`` integers; ignored where the rank rejected its input),
    after every rank has raised if any rank rejected its input."""
    return start_gather_checked(op, group, problem, row, width)()


def start_gather_checked(op: str, group, problem: Exception | None, row: Sequence[int],
                         width: int) -> Callable[[], list[list[int]]]:
    """``gather_checked``, started: the small gather travels while the caller computes
    something local; calling the result waits for it (and raises as ``gather_checked``)."""
    mark(op)  # the launcher's watchdog: this rank reached op's check
    mine = [1] + [0] * width if problem is not None else [0, *map(int, row)]
    assert len(mine) == width + 1, (op, mine, width)
    mine = torch.tensor(mine, dtype=torch.int64, device=meta_device(group))
    everyone = mine.new_empty(dist.get_world_size(group) * mine.numel())
    work = dist_all_gather(everyone, mine, group, async_op=True)

    def result() -> list[list[int]]:
        work.wait()
        table = everyone.view(-1, mine.numel()).tolist()
        raise_together(op, group, any(r[0] for r in table), problem)
        return [r[1:] for r in table]

    return result


def raise_together(op: str, group, failed: bool, problem: Exception | None) -> None:
    """Every rank raises when any rank's check failed (``failed`` is the same everywhere).

    The failing ranks raise their own error; the others one of the same type that
    names them and carries their messages (one ``all_gather_object``, on this path only).
    """
    if not failed:
        return
    reports = [None] * dist.get_world_size(group)
    mine = None if problem is None else (isinstance(problem, TypeError), str(problem))
    dist.all_gather_object(reports, mine, group=group)
    if problem is not None:
        raise problem
    bad = [(r, report) for r, report in enumerate(reports) if report is not None]
    kind = TypeError if bad[0][1][0] else ValueError
    raise kind(f"{op}: input rejected on " + "; ".join(f"rank {r}: {text}" for r, (_, text) in bad))

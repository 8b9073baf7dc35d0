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

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..runtime.progress import mark
from ..transport.base import dist_all_gather
from ..transport.calls import dtype_code, dtype_named

__all__ = ["check_chunks", "chunks_code", "check_same", "dtype_code", "gather_checked",
           "start_gather_checked", "meta_device", "raise_together"]


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

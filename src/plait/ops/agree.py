"""What every rank must agree on before data moves: shapes, and each rank's verdict on its input.

One small all_gather per call carries every rank's integers (dtype code, dims,
per-rank sizes) and whether its own input passed its local checks, so a bad
input on any rank raises the same error on every rank, before any data
collective, instead of leaving the peers inside a collective it never joins.
It is never cached: a cache per rank would let one rank skip a gather its
peers join, the moment one rank's shapes change alone (the balancer does that).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..runtime.compat import all_gather_into
from ..runtime.progress import mark

__all__ = ["attempt", "check_chunks", "chunks_code", "gather_checked", "start_gather_checked",
           "meta_device", "raise_together"]


def chunks_code(chunks) -> int:
    """``chunks`` as one integer for the cross-rank check: 0 for "auto"."""
    return 0 if chunks == "auto" else chunks


def check_chunks(op: str, chunks) -> None:
    if chunks != "auto" and (not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1):
        raise ValueError(f"{op}: chunks must be 'auto' or a positive integer, got {chunks!r}")


def attempt(check):
    """``(check(), None)``, or ``(None, the ValueError/TypeError it raised)``."""
    try:
        return check(), None
    except (TypeError, ValueError) as err:
        return None, err


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
    work = all_gather_into(everyone, mine, group=group, async_op=True)

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

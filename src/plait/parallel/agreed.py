"""``parallelize``'s plan, agreed by every rank before the model changes.

Every rank must split the same model by the same plan: a rank that resolved
another plan (a different dict, shard sizes, or a model built without a common
seed) would send collectives of other sizes, which gloo reports as a size
mismatch on one rank and a reset connection on another (measured: a 60-line
traceback through transformers, no word of the plan). So after resolving, and
before anything is built, every rank's outcome goes to every rank (one
``all_gather_object``): a rank's error is raised on every rank (the same
message where every rank had it, else naming the rank), and a difference
between two ranks' plans or weights is a ``ValueError`` on every rank naming
the first entry that differs.

What is compared (``describe``): each split module's style, each dim's shares,
each one-module style's shares, and every parameter's shape and float64 sum
(a fingerprint of the weights every rank cuts its shard from).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["describe", "agree"]


def describe(model: nn.Module, styles: dict, dims: list, plans: dict) -> list[str]:
    """The resolved plan and the weights' fingerprint, one line an entry, in a fixed order."""
    lines = [f"{path}: {style!r}" for path, style in sorted(styles.items())]
    lines += [f"{dim.name}: shares {list(dim.plan.sizes)}" for dim in dims]
    lines += [f"{path}: shares {list(plan.sizes)}" for path, plan in sorted(plans.items())
              if plan is not None]
    with torch.no_grad():  # compared as text: NaN sums compare equal too
        lines += [f"weights {name}: {tuple(p.shape)}, sum {_sum(p)}"
                  for name, p in model.named_parameters()]
    return lines


def _sum(p: torch.Tensor) -> str:
    """The parameter's float64 sum as text; a meta tensor (no values yet) only says so."""
    return "meta" if p.is_meta else repr(float(p.detach().double().sum()))


def agree(mine: list[str] | None, problem: Exception | None, group) -> None:
    """Raise on every rank if any rank had a ``problem`` or the ranks' descriptions differ."""
    world = dist.get_world_size(group)
    if world == 1:
        if problem is not None:
            raise problem
        return
    sent = ("error", type(problem).__name__, str(problem)) if problem is not None \
        else ("plan", mine)
    every: list = [None] * world
    dist.all_gather_object(every, sent, group=group)
    errors = [(rank, got) for rank, got in enumerate(every) if got[0] == "error"]
    if errors:
        rank, (_, kind, message) = errors[0]
        if problem is not None and len(errors) == world and \
                all(got[1:] == errors[0][1][1:] for _, got in errors):
            raise problem  # every rank saw the same mistake: its own message
        cls = TypeError if kind == "TypeError" else ValueError
        raise cls(f"rank {rank}: {message} (every rank must call parallelize with the same "
                  "plan on the same model)")
    first = every[0][1]
    for rank, (_, theirs) in enumerate(every[1:], start=1):
        if theirs != first:
            raise ValueError(_difference(first, theirs, rank))


def _difference(ours: list[str], theirs: list[str], rank: int) -> str:
    """The first entry where rank 0's description and ``rank``'s differ, as one line."""
    for a, b in zip(ours, theirs):
        if a != b:
            if a.startswith("weights ") and b.startswith("weights "):
                return (f"rank {rank}'s weights differ from rank 0's ({a.split(':')[0][8:]}: "
                        f"{a.split(': ', 1)[1]} on rank 0, {b.split(': ', 1)[1]} on rank "
                        f"{rank}): build the model from one seed on every rank, or load the "
                        "same checkpoint")
            return (f"the ranks' plans differ: rank 0 has {a}, rank {rank} has {b} (every "
                    "rank must call parallelize with the same plan on the same model)")
    longer, which = (ours, 0) if len(ours) > len(theirs) else (theirs, rank)
    extra = longer[min(len(ours), len(theirs))]
    return (f"the ranks' plans differ: only rank {which} has {extra} (every rank must call "
            "parallelize with the same plan on the same model)")

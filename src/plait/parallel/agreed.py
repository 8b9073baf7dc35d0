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
each one-module style's shares, and the shape and a fingerprint (the sum of its
bits as integers, exact in any order) of every parameter of the modules the plan
splits: the weights every rank cuts its shard from. Within the group (the tp
group on a dp × tp mesh); a group of one compares nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["describe", "agree"]


def describe(model: nn.Module, styles: dict, dims: list, plans: dict) -> list[str]:
    """The resolved plan and a fingerprint of the weights it cuts, one line an entry, in a
    fixed order. Only the modules this plan splits are fingerprinted: a module an earlier
    ``parallelize`` call split holds a different shard on every rank by design."""
    lines = [f"{path}: {style!r}" for path, style in sorted(styles.items())]
    lines += [f"{dim.name}: shares {list(dim.plan.sizes)}" for dim in dims]
    lines += [f"{path}: shares {list(plan.sizes)}" for path, plan in sorted(plans.items())
              if plan is not None]
    modules = dict(model.named_modules())
    with torch.no_grad():
        for path in sorted(styles):
            for name, p in modules[path].named_parameters():
                lines.append(f"weights {path}.{name}: {tuple(p.shape)}, {_fingerprint(p)}")
    return lines


_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int32}
_CHUNK = 1 << 24  # elements summed at a time: the int64 copy stays small


def _fingerprint(p: torch.Tensor) -> str:
    """The sum of the parameter's bits read as integers: exact and in any order the same
    (a float sum's rounding depends on the thread count: measured, 4M float32 values summed
    to different last digits on 1 and 2 threads); a meta tensor only says so."""
    if p.is_meta:
        return "meta"
    flat = p.detach().contiguous().view(-1)
    bits = flat.view(torch.uint8).view(_INTS[flat.element_size()]) if flat.numel() else flat
    total = 0
    for lo in range(0, bits.numel(), _CHUNK):
        total += int(bits[lo:lo + _CHUNK].to(torch.int64).sum())
    return f"bits {total}"


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
                return (f"rank {rank}'s weights differ from rank 0's ({a.split(':')[0][8:]}): "
                        "build the model from one seed on every rank, or load the same "
                        "checkpoint")
            return (f"the ranks' plans differ: rank 0 has {a}, rank {rank} has {b} (every "
                    "rank must call parallelize with the same plan on the same model)")
    longer, which = (ours, 0) if len(ours) > len(theirs) else (theirs, rank)
    extra = longer[min(len(ours), len(theirs))]
    return (f"the ranks' plans differ: only rank {which} has {extra} (every rank must call "
            "parallelize with the same plan on the same model)")

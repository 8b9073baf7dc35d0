"""Partition plans: how many units of one tensor dim each rank owns.

A :class:`ShardPlan` is a plain value (no torch, no torch.distributed): the
layers of :mod:`plait.nn`, checkpoints, the balancer and the performance model
all speak it. Rank r owns the contiguous units ``[offsets[r], offsets[r + 1])``;
a unit is whatever the owner counts in (columns, heads, experts, tables,
tokens), and a layer says how many tensor elements one unit is.

    >>> plan = ShardPlan.even(10, 3)
    >>> plan.sizes, plan.offsets, plan.slice_of(2)
    ((4, 3, 3), (0, 4, 7, 10), slice(7, 10, None))
    >>> ShardPlan.proportional(12, speeds=[2.0, 1.0]).sizes
    (8, 4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["ShardPlan", "head_split"]


@dataclass(frozen=True)
class ShardPlan:
    """``sizes[r]``: the units rank r owns, in rank order; rank r's slice is contiguous."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        sizes = self.sizes
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise TypeError(f"shard sizes must be a sequence of integers, got {sizes!r}")
        sizes = tuple(sizes)
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool)]
        if bad:
            raise TypeError(f"shard sizes {list(sizes)} must be integers, got {bad[0]!r}")
        if not sizes:
            raise ValueError("shard sizes [] name no rank; a plan needs one size per rank")
        if any(s < 0 for s in sizes):
            raise ValueError(f"shard sizes {list(sizes)} have a negative size")
        object.__setattr__(self, "sizes", sizes)

    # --- constructors ------------------------------------------------------
    @classmethod
    def even(cls, total: int, world: int, quantum: int = 1) -> "ShardPlan":
        """``total`` units over ``world`` ranks as evenly as whole quanta allow (larger first)."""
        units = _quanta(total, quantum)
        if world < 1:
            raise ValueError(f"a plan needs at least one rank, got world size {world}")
        base, extra = divmod(units, world)
        return cls(tuple((base + (r < extra)) * quantum for r in range(world)))

    @classmethod
    def proportional(cls, total: int, speeds: Sequence[float], quantum: int = 1,
                     minimum: int = 1) -> "ShardPlan":
        """Shares of ``total`` in proportion to ``speeds`` (largest remainder), in whole quanta.

        Every rank gets at least ``minimum`` quanta (as far as there are enough),
        so a slow rank is given less work, not none: its collectives keep their shape.
        """
        units = _quanta(total, quantum)
        speeds = [float(s) for s in speeds]
        if not speeds or any(not math.isfinite(s) or s <= 0 for s in speeds):
            raise ValueError(f"speeds {speeds} must be positive and finite, one per rank")
        exact = [units * s / sum(speeds) for s in speeds]
        shares = [int(e) for e in exact]
        by_remainder = sorted(range(len(speeds)), key=lambda r: (shares[r] - exact[r], r))
        for r in by_remainder[:units - sum(shares)]:
            shares[r] += 1
        floor = min(minimum, units // len(speeds))
        for r in range(len(shares)):  # lift a starved rank with units from the largest share
            while shares[r] < floor:
                donor = max(range(len(shares)), key=lambda d: (shares[d], -d))
                shares[donor] -= 1
                shares[r] += 1
        return cls(tuple(s * quantum for s in shares))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ShardPlan":
        if not isinstance(data, dict) or "sizes" not in data:
            raise ValueError(f"a ShardPlan dict needs 'sizes', got {data!r}")
        return cls(tuple(data["sizes"]))

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes)}

    # --- what it says ------------------------------------------------------
    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each rank's slice, and the end: ``len == world + 1``."""
        out = [0]
        for size in self.sizes:
            out.append(out[-1] + size)
        return tuple(out)

    def start_of(self, rank: int) -> int:
        return self.offsets[self._rank(rank)]

    def slice_of(self, rank: int) -> slice:
        rank = self._rank(rank)
        offsets = self.offsets
        return slice(offsets[rank], offsets[rank + 1])

    def owner_of(self, unit: int) -> int:
        """The rank whose slice holds ``unit`` (the first such, past empty ranks)."""
        if not 0 <= unit < self.total:
            raise ValueError(f"unit {unit} is outside the plan's {self.total} units")
        offsets = self.offsets
        return next(r for r in range(self.world) if offsets[r] <= unit < offsets[r + 1])

    def scaled(self, factor: int) -> "ShardPlan":
        """The same split counted in smaller units (heads → columns: ``factor`` = head dim)."""
        if factor < 1:
            raise ValueError(f"a plan scales by a positive integer, got {factor}")
        return ShardPlan(tuple(s * factor for s in self.sizes))

    def check(self, total: int, world: int, *, what: str = "units", layer: str = "",
              allow_empty: bool = False) -> "ShardPlan":
        """Refuse a plan that does not fit a dim of ``total`` units on ``world`` ranks."""
        where = f"{layer}: " if layer else ""
        if self.world != world:
            raise ValueError(f"{where}shard sizes {list(self.sizes)} name {self.world} ranks, "
                             f"but the group has {world}")
        if self.total != total:
            raise ValueError(f"{where}shard sizes {list(self.sizes)} sum to {self.total} {what}, "
                             f"but the dimension has {total}")
        if not allow_empty:
            empty = [r for r, s in enumerate(self.sizes) if s == 0]
            if empty:
                ranks = ", ".join(map(str, empty))
                raise ValueError(f"{where}shard sizes {list(self.sizes)} leave rank"
                                 f"{'s' if len(empty) > 1 else ''} {ranks} with no {what}")
        return self

    def _rank(self, rank: int) -> int:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the plan's {self.world} ranks")
        return rank


def _quanta(total: int, quantum: int) -> int:
    if quantum < 1:
        raise ValueError(f"quantum must be a positive integer, got {quantum}")
    if total < 0 or total % quantum:
        raise ValueError(f"total {total} is not a non-negative multiple of the quantum {quantum}")
    return total // quantum


def head_split(n_q: int, n_kv: int, world: int, total: int | None = None) -> int:
    """``m``, the sub-groups each KV-head group is cut into (1: whole groups), for a plan of
    ``total`` units (default: the fewest sub-groups that give every rank one). Attention
    over ``n_q`` query heads in ``n_kv`` groups is planned in units of whole sub-groups;
    where the ranks outnumber the groups, each K/V head is copied into its sub-groups."""
    g = n_q // n_kv
    if total is not None:
        m, rest = divmod(total, n_kv)
        if rest or m < 1 or g % m:
            subs = [n_kv * d for d in range(1, g + 1) if g % d == 0]
            raise ValueError(f"a plan of {total} units does not count this attention's KV-head "
                             f"groups ({n_kv} groups of {g} query heads): it may count "
                             f"{' or '.join(map(str, subs))} (groups, or groups cut into "
                             "sub-groups that each copy their K/V head)")
        return m
    for m in range(1, g + 1):
        if g % m == 0 and n_kv * m >= world:
            return m
    raise ValueError(f"{n_q} query heads cannot give each of {world} ranks a whole head")

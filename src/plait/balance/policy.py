"""Balancing decisions: pure functions of measured speeds that return plans and actions
(the state machine that makes them step by step, one per sharded dim: :mod:`.semi`).

Nothing here touches torch or torch.distributed; the caller applies what it is
told (``plait.balance.migrate`` for a new plan, the layers for resize
fractions). Speeds are work per second, relative (fastest = 1), as
``SpeedMonitor.speeds()`` gives them; because they count work, not time, they
do not change when a plan moves work, so a decision made from them is stable.

Rank r with speed s_r owning n_r units of which it computes a fraction k_r
takes ``t_r ∝ n_r k_r / s_r``; the collective after it waits for ``max_r t_r``.
Where a rank also spends time on work no plan moves (its replicated layers, the
optimizer, Python: ``SpeedMonitor.fixed()``), ``fixed[r]`` is that time as a share of
the whole movable compute done at the fastest rank's speed, and ``t_r ∝ n_r k_r / s_r
+ fixed[r] · Σ n``: a rank slow at everything (a throttled host) is also slow at what
stays with it, so it is given less than its speed's share.

    >>> static_plan(64, [1.0, 0.5], quantum=8).sizes
    (40, 24)
    >>> resize_fraction([1.0, 0.5], 1)
    0.5
    >>> static_plan(1024, [1.0, 0.5], fixed=[0.225, 0.45]).sizes
    (759, 265)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..plan import ShardPlan

__all__ = ["POLICIES", "PolicyConfig", "Action", "static_plan", "resize_fraction",
           "resize_fractions", "imbalance", "check_speeds", "check_fixed"]

POLICIES = ("even", "static", "resize", "migrate", "semi")  # the names perf.hetero uses too


@dataclass(frozen=True, kw_only=True)
class PolicyConfig:
    """How the balancer decides. Ratios are slowest-to-fastest step-time ratios (≥ 1)."""

    name: str = "semi"
    """even | static (one proportional plan, once) | resize | migrate | semi (resize spikes,
    migrate what persists)."""
    quantum: int = 1
    """Plan sizes are multiples of this many units (what the hardware likes, e.g. 8 or 64)."""
    trigger: float = 1.2
    """Act once the predicted imbalance (slowest / fastest rank time) reaches this."""
    release: float = 1.1
    """Count as balanced again only below this; ``release < trigger`` is the hysteresis."""
    spike_steps: int = 30
    """semi: an imbalance lasting fewer steps is a spike (resized, then undone); one that
    lasts this long persists and is migrated."""
    confirm_steps: int = 1
    """Act on an imbalance only once it has lasted this many steps (1: at once); more
    ignores a single noisy reading of the speeds on a shared machine."""
    settle_steps: int = 5
    """Steps of balance before resizing is undone or a migrated plan returns to even."""
    max_skip: float = 0.5
    """The largest fraction of its reduction dim a resized rank may skip (0 ≤ . < 1)."""
    migrate_cost_steps: float = 1.0
    """semi: what one migration costs, in steps of the dim's compute, until one is measured
    (``SemiPolicy.note_migration_cost``)."""
    min_confidence: float = 0.5
    """Decide nothing on speeds whose confidence (``SpeedMonitor.confidence()``) is lower."""

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"unknown balancing policy {self.name!r}; known: {', '.join(POLICIES)}")
        for field in ("quantum", "spike_steps", "confirm_steps", "settle_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if not (1.0 < self.release < self.trigger and math.isfinite(self.trigger)):
            raise ValueError(f"need 1 < release < trigger for hysteresis, got release="
                             f"{self.release}, trigger={self.trigger}")
        if not (self.migrate_cost_steps >= 0.0 and math.isfinite(self.migrate_cost_steps)):
            raise ValueError(f"migrate_cost_steps must be a finite number of steps ≥ 0, got "
                             f"{self.migrate_cost_steps}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if not 0.0 <= self.max_skip < 1.0:
            raise ValueError(f"max_skip must be in [0, 1) (a rank keeps some of its work), "
                             f"got {self.max_skip}")


@dataclass(frozen=True)
class Action:
    """What to apply at this step boundary.

    kind: ``none`` | ``resize`` (``fractions[r]``: the share of its reduction dim rank r
    computes) | ``migrate`` (move to ``plan`` exactly; any resizing ends) | ``undo``
    (end resizing, keep the plan). ``reason`` says why, for the log.
    """

    kind: str
    reason: str
    plan: ShardPlan | None = None
    fractions: tuple[float, ...] | None = None


def check_speeds(speeds: Sequence[float], world: int | None = None) -> tuple[float, ...]:
    """Speeds as floats, refused unless positive, finite and one per rank."""
    out = tuple(float(s) for s in speeds)
    if not out or any(not math.isfinite(s) or s <= 0 for s in out):
        raise ValueError(f"speeds {list(out)} must be positive and finite, one per rank")
    if world is not None and len(out) != world:
        raise ValueError(f"speeds {list(out)} name {len(out)} ranks, but the group has {world}")
    return out


def check_fixed(fixed: Sequence[float] | None, world: int) -> tuple[float, ...]:
    """Each rank's unmovable time (see the module doc) as floats, zeros if None; refused
    unless finite, ≥ 0 and one per rank."""
    if fixed is None:
        return (0.0,) * world
    out = tuple(float(f) for f in fixed)
    if len(out) != world or any(not math.isfinite(f) or f < 0 for f in out):
        raise ValueError(f"fixed times {list(out)} must be finite and ≥ 0, one per rank "
                         f"of {world}")
    return out


def _shares(speeds: tuple[float, ...], fixed: tuple[float, ...]) -> tuple[float, ...]:
    """The shares (summing to 1) that finish every rank together when rank r also spends
    ``fixed[r]`` (a share of the whole dim at speed 1) on work no plan moves: ``n_r =
    s_r (X − fixed[r])``. A rank whose unmovable time alone exceeds the pace gets
    (almost) nothing, and the others share the dim without it."""
    active = list(range(len(speeds)))
    while True:
        pace = (1.0 + sum(speeds[r] * fixed[r] for r in active)) / sum(speeds[r] for r in active)
        out = [speeds[r] * (pace - fixed[r]) if r in active else 0.0
               for r in range(len(speeds))]
        starved = [r for r in active if out[r] <= 0]
        if not starved or len(starved) == len(active):
            return tuple(max(v, 1e-9) for v in out)
        active = [r for r in active if r not in starved]


def static_plan(total: int, speeds: Sequence[float], quantum: int = 1, *,
                allow_empty: bool = False, fixed: Sequence[float] | None = None) -> ShardPlan:
    """``total`` units in shares proportional to ``speeds``, in whole quanta, summing exactly;
    with ``fixed`` (each rank's unmovable time, see the module doc) the shares that finish
    every rank together in the module doc's model, a sum over the whole step (the step's
    collectives split it into segments, which that model does not see).

    Every rank gets at least one quantum unless ``allow_empty``; a dim with fewer
    quanta than ranks is then refused rather than starving a rank.
    """
    speeds = check_speeds(speeds)
    if fixed is not None and any(check_fixed(fixed, len(speeds))):
        speeds = _shares(speeds, check_fixed(fixed, len(speeds)))
    if quantum < 1 or total < 0 or total % quantum:
        raise ValueError(f"total {total} is not a non-negative multiple of the quantum {quantum}; "
                         f"pick a quantum that divides it (e.g. {math.gcd(total, quantum) or 1})")
    if not allow_empty and total // quantum < len(speeds):
        raise ValueError(f"{total} units in quanta of {quantum} give {total // quantum} quanta, "
                         f"fewer than the {len(speeds)} ranks that each need some work")
    return ShardPlan.proportional(total, speeds, quantum=quantum, minimum=0 if allow_empty else 1)


def resize_fractions(speeds: Sequence[float], plan: ShardPlan | None = None,
                     max_skip: float = 1.0,
                     fixed: Sequence[float] | None = None) -> tuple[float, ...]:
    """The share of its reduction dim each rank keeps so that all finish with the fastest.

    Under ``plan`` (even if None) rank r takes ``n_r k_r / s_r + u_r`` (``u_r``: its
    unmovable time, ``fixed[r] · Σ n``); the pace is the quickest rank's whole time
    ``min_r (n_r / s_r + u_r)`` and k_r is clipped to ``[1 - max_skip, 1]``.
    """
    speeds = check_speeds(speeds)
    sizes = [1] * len(speeds) if plan is None else list(plan.sizes)
    if len(sizes) != len(speeds):
        raise ValueError(f"speeds {list(speeds)} name {len(speeds)} ranks, plan {sizes} {len(sizes)}")
    unmoved = [f * sum(sizes) for f in check_fixed(fixed, len(speeds))]
    times = [n / s for n, s in zip(sizes, speeds)]
    whole = [t + u for t, u in zip(times, unmoved)]
    pace = min(w for w, t in zip(whole, times) if t > 0) if any(times) else 0.0
    return tuple(1.0 if w <= pace else max(1.0 - max_skip, max(pace - u, 0.0) / t)
                 for w, t, u in zip(whole, times, unmoved))


def resize_fraction(speeds: Sequence[float], rank: int, plan: ShardPlan | None = None,
                    max_skip: float = 1.0, fixed: Sequence[float] | None = None) -> float:
    """Rank ``rank``'s entry of :func:`resize_fractions`."""
    fractions = resize_fractions(speeds, plan, max_skip, fixed)
    if not 0 <= rank < len(fractions):
        raise ValueError(f"rank {rank} is outside the {len(fractions)} ranks of speeds {list(speeds)}")
    return fractions[rank]


def imbalance(speeds: Sequence[float], plan: ShardPlan | None = None,
              fractions: Sequence[float] | None = None,
              fixed: Sequence[float] | None = None) -> float:
    """Slowest over fastest rank time (1 = balanced) under ``plan`` and ``fractions``, each
    rank's unmovable time (``fixed``, see the module doc) included."""
    speeds = check_speeds(speeds)
    sizes = [1] * len(speeds) if plan is None else plan.sizes
    keep = [1.0] * len(speeds) if fractions is None else fractions
    unmoved = [f * sum(sizes) for f in check_fixed(fixed, len(speeds))]
    times = [n * k / s + u for n, k, s, u in zip(sizes, keep, speeds, unmoved) if n * k > 0]
    return max(times) / min(times) if times else 1.0

"""Placing MoE experts by their routed load and the ranks' speeds: a pure function.

In a mixture of experts the router makes ranks uneven by itself: a few hot experts draw most
tokens, and the rank holding them sets everyone's pace at both all-to-alls. Given each
expert's load (tokens routed to it, per step), each rank's speed at expert work (tokens a
second, relative), how many experts each rank can hold (``slots``, its memory) and how many
copies of one expert may exist (``max_replicas``), :func:`place_experts` returns where each
expert's replicas live and the share of its tokens each one takes. Its objective is the
slowest rank's expert time, ``max_r Σ_e load_e · share_(e,r) / speed_r``, against the
ideal, all expert work at the ranks' summed speeds (:func:`ideal_time`).

The rule is the wrap-around fill of preemptive scheduling on machines of different speeds,
made for replicas: each rank gets a capacity of ``ideal × speed_r`` tokens; the experts,
heaviest first, go to the rank with the most capacity left (ties: a rank that holds the
expert now, then the lowest rank); an expert larger than what is left there is split, its
rest going on to the next such rank as a replica. Splits happen only at a rank's capacity,
so at most ``world − 1`` replicas are made and, where slots and ``max_replicas`` allow,
every rank ends at the ideal. A remainder with nowhere left to go (no free slot, or
``max_replicas`` copies made) stays on the expert's last replica: over the ideal there,
never lost; a replica never takes the slot an expert still to be placed needs. Replicas
process different tokens side by side, so a split costs no time, only a copy of the
expert's weights (and its optimizer state, in training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["ExpertPlacement", "ExpertBalancer", "place_experts", "even_placement", "ideal_time",
           "imbalance", "moves"]

_EPS = 1e-12  # a remainder this small (relative to the expert's load) is no replica


@dataclass(frozen=True)
class ExpertPlacement:
    """``replicas[e]``: expert e's ``(rank, share)`` pairs, shares summing to 1, its first
    replica the one it had longest. ``world``: the ranks."""

    replicas: tuple[tuple[tuple[int, float], ...], ...]
    world: int

    def loads(self, loads: Sequence[float]) -> list[float]:
        """Each rank's tokens: Σ_e load_e · its share there."""
        out = [0.0] * self.world
        for load, homes in zip(loads, self.replicas):
            for rank, share in homes:
                out[rank] += load * share
        return out

    def times(self, loads: Sequence[float], speeds: Sequence[float]) -> list[float]:
        """Each rank's expert time: its tokens over its speed."""
        return [tokens / speed for tokens, speed in zip(self.loads(loads), speeds)]

    def experts_on(self, rank: int) -> list[int]:
        """The experts ``rank`` holds a replica of."""
        return [e for e, homes in enumerate(self.replicas) if any(r == rank for r, _ in homes)]

    def copies(self) -> int:
        """Replicas beyond one per expert."""
        return sum(len(homes) - 1 for homes in self.replicas)


def ideal_time(loads: Sequence[float], speeds: Sequence[float]) -> float:
    """All the experts' tokens at the ranks' summed speeds."""
    return sum(loads) / sum(speeds)


def imbalance(times: Sequence[float]) -> float:
    """The slowest rank's time over the mean rank's (1: even)."""
    mean = sum(times) / len(times)
    return max(times) / mean if mean > 0 else 1.0


def even_placement(experts: int, world: int) -> ExpertPlacement:
    """Contiguous blocks of experts, the first ranks one more where they do not divide (what
    an even expert-parallel plan holds), one replica each."""
    base, extra = divmod(experts, world)
    replicas, rank, left = [], 0, base + (extra > 0)
    for _ in range(experts):
        while left == 0:
            rank += 1
            left = base + (rank < extra)
        replicas.append(((rank, 1.0),))
        left -= 1
    return ExpertPlacement(tuple(replicas), world)


def place_experts(loads: Sequence[float], speeds: Sequence[float], *,
                  slots: int | Sequence[int] | None = None, max_replicas: int | None = None,
                  current: ExpertPlacement | None = None) -> ExpertPlacement:
    """Where each expert's replicas go and the share of its tokens each takes (module doc).

    ``loads``: tokens routed to each expert (any unit, ≥ 0); ``speeds``: each rank's
    relative speed (> 0); ``slots``: how many expert replicas each rank can hold (default:
    no limit); ``max_replicas``: copies one expert may have (default: one a rank; 1: no
    replicas); ``current``: the placement now, kept where the fill is otherwise indifferent
    (fewer moves)."""
    world, experts = len(speeds), len(loads)
    free = _slots(slots, world, experts)
    cap_copies = world if max_replicas is None else max(1, min(int(max_replicas), world))
    if world < 1 or any(not s > 0 for s in speeds):
        raise ValueError(f"speeds must be positive, one a rank, got {list(speeds)}")
    if any(load < 0 for load in loads):
        raise ValueError(f"loads must be non-negative, got {list(loads)}")
    if sum(free) < experts:
        raise ValueError(f"{experts} experts do not fit {sum(free)} slots ({list(free)})")
    ideal = ideal_time(loads, speeds) if sum(loads) > 0 else 0.0
    room = [ideal * s for s in speeds]  # tokens each rank takes to end at the ideal
    held = [set() if current is None else set(current.experts_on(r)) for r in range(world)]
    count = [0] * world
    homes: list[list[list]] = [[] for _ in range(experts)]

    def put(e: int, r: int, tokens: float) -> None:
        homes[e].append([r, tokens])
        free[r] -= 1
        count[r] += 1
        room[r] -= tokens

    def onto_last(e: int, tokens: float) -> None:  # over the ideal there, never lost
        homes[e][-1][1] += tokens
        room[homes[e][-1][0]] -= tokens

    unplaced = experts
    for e in sorted(range(experts), key=lambda e: (-loads[e], e)):  # heaviest first
        rest, tol = float(loads[e]), _EPS * max(float(loads[e]), 1.0)
        unplaced -= 1
        while True:
            # a replica may take a slot only where every expert still to come keeps one
            spare = not homes[e] or sum(free) > unplaced
            ranks = [r for r in range(world) if spare and free[r] > 0 and
                     all(r != home[0] for home in homes[e])]
            if not ranks or len(homes[e]) == cap_copies:
                onto_last(e, rest)
                break
            # the most room left; then the rank holding it now, the fewest experts, the lowest
            r = max(ranks, key=lambda r: (room[r], e in held[r], -count[r], -r))
            final = len(ranks) == 1 or len(homes[e]) + 1 == cap_copies or room[r] >= rest - tol
            take = rest if final else max(room[r], 0.0)
            if take <= tol and not final:
                if homes[e]:  # the best rank has no room: a split would carry nothing
                    onto_last(e, rest)
                    break
                take = rest  # no rank has room: all of it where most is
            put(e, r, take)
            rest -= take
            if rest <= tol:
                if rest > 0:
                    onto_last(e, rest)
                break
    replicas = []
    for e in range(experts):
        total = sum(t for _, t in homes[e])
        shares = [(r, t / total if total > 0 else 1.0 / len(homes[e])) for r, t in homes[e]]
        replicas.append(tuple(shares))
    return ExpertPlacement(tuple(replicas), world)


def moves(old: ExpertPlacement, new: ExpertPlacement) -> int:
    """Replicas ``new`` puts on a rank that held no copy of the expert in ``old``: each is a
    copy of the expert's weights (and in training its optimizer state) over the wire."""
    return sum(len({r for r, _ in b} - {r for r, _ in a})
               for a, b in zip(old.replicas, new.replicas))


@dataclass
class ExpertBalancer:
    """SEMI's rule for experts: re-place when the predicted gain pays for the move.

    Each ``observe`` takes a step's routed loads (the counts the all-to-all's own count
    exchange carries: no extra round trip) and the ranks' speeds, smooths both (an EMA,
    ``smoothing`` the newest reading's weight), and compares the slowest rank's expert time
    under the current placement with :func:`place_experts`' placement. It moves when, for
    ``confirm`` readings in a row, the gain is at least ``threshold`` of the step's expert
    time and the gain over ``horizon`` steps exceeds the copies it makes times
    ``move_cost`` (a copy's cost in steps of expert time). Jitter alone (a router's
    counts round an even skew) predicts a gain under the threshold: no move."""

    placement: ExpertPlacement
    max_replicas: int | None = None
    slots: int | Sequence[int] | None = None
    smoothing: float = 0.5
    threshold: float = 0.05
    confirm: int = 2
    horizon: int = 20
    move_cost: float = 0.05
    loads: list[float] | None = None
    speeds: list[float] | None = None
    streak: int = 0
    log: list[dict] | None = None

    def observe(self, step: int, loads: Sequence[float],
                speeds: Sequence[float]) -> ExpertPlacement | None:
        """The new placement where this reading makes a move, else None."""
        a = self.smoothing
        self.loads = list(map(float, loads)) if self.loads is None else \
            [a * x + (1 - a) * y for x, y in zip(loads, self.loads)]
        self.speeds = list(map(float, speeds)) if self.speeds is None else \
            [a * x + (1 - a) * y for x, y in zip(speeds, self.speeds)]
        now = max(self.placement.times(self.loads, self.speeds))
        best = place_experts(self.loads, self.speeds, slots=self.slots,
                             max_replicas=self.max_replicas, current=self.placement)
        gain = (now - max(best.times(self.loads, self.speeds))) / now if now > 0 else 0.0
        copies = moves(self.placement, best)
        pays = gain >= self.threshold and gain * self.horizon > copies * self.move_cost
        self.streak = self.streak + 1 if pays else 0
        if self.streak < self.confirm:
            return None
        self.streak = 0
        self.placement = best
        self.log = (self.log or []) + [{"step": step, "gain": round(gain, 4), "copies": copies}]
        return best


def _slots(slots, world: int, experts: int) -> list[int]:
    if slots is None:
        return [experts] * world
    if isinstance(slots, int):
        return [slots] * world
    if len(slots) != world:
        raise ValueError(f"slots names {len(slots)} ranks, speeds {world}")
    return [int(s) for s in slots]

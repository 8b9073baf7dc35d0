"""Straggler emulation: make one rank FACTOR times slower at compute.

The delay is proportional to the compute the rank actually does: the work
runs, its duration ``d`` is measured, then the rank waits ``(FACTOR − 1)·d``.
On a CPU rank running one thread, ``d`` is the thread's CPU time, not wall
time: ranks sharing cores (four ranks on two) wait for the scheduler in the
middle of a GEMM, and that wait is not compute a slower device would stretch.
Giving that rank less work therefore really shortens its delay, as on a slower
device, which is what the balancer needs to be tested against. The wait is a
sleep, so the emulated slowness does not steal CPU from other ranks.

Or the kernel makes the slowdown (``throttle``, ``bench hetero --slow-by kernel``): at every
step the factor ``F`` goes to ``throttle(F)``, which sets the rank's host's CPU budget to its
full budget ÷ ``F`` (:func:`host_throttle`, a cgroup cpu quota, :mod:`plait.runtime.slow.cgroup`),
and nothing sleeps. The host is then slow at everything it runs, collectives' CPU and Python
included, and its compute is timed by the wall clock (:func:`compute_clock`).

A slowdown is a :class:`SlowSpec` (one factor over a window of steps, ``--slow``) or a
:class:`SlowCurve` (a factor that changes with the step: piecewise-linear drift times
periodic or seeded random jitter; what a scenario file, :mod:`plait.runtime.slow.scenario_file`,
becomes). Both answer ``factor_at(step)``; a rank's factors multiply.
"""

from __future__ import annotations

import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .. import current

if TYPE_CHECKING:  # torch loads where a rank computes, not where the CLI parses --slow
    import torch

__all__ = ["SlowSpec", "SlowCurve", "JITTERS", "SLOW_BY", "parse_slow", "validate_slow",
           "once_per_rank", "Straggler", "compute_clock", "host_throttle"]

SLOW_BY = ("sleep", "kernel")  # how a factor is made: a sleep after each piece, or a CPU quota


def compute_clock(device: torch.device | None = None):
    """The clock compute is measured by: this thread's CPU time on a one-thread CPU rank (what
    the compute cost, whoever else shares the core), wall time otherwise, and wall time on a
    host with a CPU budget (``--host-cpu``): time spent throttled by the kernel is not CPU
    time, so a rank on a half-core host would read as full speed by its CPU time."""
    if _on_cpu_budget():
        return time.perf_counter
    import torch

    if (device is None or device.type == "cpu") and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _cuda_sync(device) -> Callable[[], None]:
    """What waits for ``device``'s queued kernels before a clock reads it: nothing on a CPU."""
    if device is None or device.type != "cuda":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def _on_cpu_budget() -> bool:
    ctx = current.get()  # the rank's context, where one is set (not made here)
    return ctx is not None and getattr(ctx.host, "cgroup", None) is not None

_SLOW_RE = re.compile(r"^(\d+):(\d+(?:\.\d+)?)(?:@(\d+)?(?:-(\d+)?)?)?$")


@dataclass(frozen=True)
class SlowSpec:
    """Rank ``rank`` computes ``factor`` × slower for steps in [from_step, until_step)."""

    rank: int
    factor: float
    from_step: int = 0
    until_step: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"--slow rank must be non-negative, got {self.rank}")
        if self.factor < 1.0:
            raise ValueError(f"--slow factor must be at least 1 (a slower rank), got {self.factor}")
        if self.until_step is not None and self.until_step <= self.from_step:
            raise ValueError(f"--slow window [{self.from_step}, {self.until_step}) is empty")

    def active(self, step: int) -> bool:
        return step >= self.from_step and (self.until_step is None or step < self.until_step)

    def factor_at(self, step: int) -> float:
        return self.factor if self.active(step) else 1.0


JITTERS = ("random", "periodic")


@dataclass(frozen=True)
class SlowCurve:
    """Rank ``rank`` computes ``factor_at(step)`` × slower: the piecewise-linear curve through
    ``points`` ((step, factor) pairs, steps increasing; flat before the first and after the
    last) times ``1 + amplitude · u``, u in [−1, 1]. ``jitter="random"``: u is uniform, drawn
    anew every ``period`` steps from (``seed``, rank, step // period) by a fixed hash, so every
    process and every call order sees the same draws; ``"periodic"``: u = sin(2π (step +
    ``phase``) / ``period``)."""

    rank: int
    points: tuple[tuple[float, float], ...]
    amplitude: float = 0.0
    jitter: str = "random"
    period: int = 1
    phase: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"a slowed rank must be non-negative, got {self.rank}")
        steps = [x for x, _ in self.points]
        if not steps or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"a slowdown curve needs points at increasing steps, got {steps}")
        lowest = min(f for _, f in self.points)
        if not all(math.isfinite(v) for p in self.points for v in p) or lowest < 1.0:
            raise ValueError(f"slowdown factors must be finite and at least 1, got "
                             f"{[f for _, f in self.points]}")
        if self.jitter not in JITTERS:
            raise ValueError(f"jitter {self.jitter!r}: choose from {list(JITTERS)}")
        if not 0.0 <= self.amplitude < 1.0:
            raise ValueError(f"jitter amplitude must be in [0, 1), got {self.amplitude}")
        if lowest * (1.0 - self.amplitude) < 1.0 - 1e-12:
            raise ValueError(f"jitter ±{self.amplitude:g} takes factor {lowest:g} below 1 "
                             f"({lowest:g} × {1 - self.amplitude:g}); a sleep cannot speed a "
                             "rank up")
        if self.period < (2 if self.jitter == "periodic" else 1):
            raise ValueError(f"{self.jitter} jitter period must be at least "
                             f"{2 if self.jitter == 'periodic' else 1} steps, got {self.period}")

    def base_at(self, step: float) -> float:
        """The curve without jitter: linear between the points, flat outside them."""
        pts = self.points
        if step <= pts[0][0]:
            return pts[0][1]
        for (x0, f0), (x1, f1) in zip(pts, pts[1:]):
            if step <= x1:
                return f0 + (f1 - f0) * (step - x0) / (x1 - x0)
        return pts[-1][1]

    def factor_at(self, step: int) -> float:
        base = self.base_at(step)
        if self.amplitude == 0.0:
            return base
        if self.jitter == "periodic":
            u = math.sin(2.0 * math.pi * (step + self.phase) / self.period)
        else:
            u = 2.0 * _unit_hash(self.seed, self.rank, step // self.period) - 1.0
        return base * (1.0 + self.amplitude * u)


def _unit_hash(*keys: int) -> float:
    """A fixed hash of integers to [0, 1) (splitmix64's mixer): the same on every process,
    unlike ``hash()``, and cheap enough to call for every compute piece."""
    mask = (1 << 64) - 1
    x = 0x9E3779B97F4A7C15
    for key in keys:
        x = (x ^ (key & mask)) * 0xBF58476D1CE4E5B9 & mask
        x = (x ^ (x >> 31)) * 0x94D049BB133111EB & mask
        x ^= x >> 29
    return (x >> 11) / float(1 << 53)


def parse_slow(text: str) -> SlowSpec:
    """``"1:2"`` (rank 1, 2 × slower throughout), ``"1:3@10-30"`` (steps 10 to 29), ``"2:4@50"`` (from 50)."""
    match = _SLOW_RE.match(text.strip())
    if not match:
        raise ValueError(
            f"cannot read --slow {text!r}; write RANK:FACTOR[@FROM[-UNTIL]], e.g. 1:2 or 1:3@10-30"
        )
    rank, factor, start, until = match.groups()
    return SlowSpec(rank=int(rank), factor=float(factor), from_step=int(start or 0),
                    until_step=int(until) if until else None)


def validate_slow(specs: Sequence[SlowSpec | SlowCurve], world_size: int) -> None:
    """Refuse a ``--slow`` that names a rank which does not exist, before anything starts."""
    for spec in specs:
        if spec.rank >= world_size:
            raise ValueError(
                f"--slow names rank {spec.rank}, but there are only {world_size} ranks "
                f"(0..{world_size - 1})"
            )


def once_per_rank(specs: Sequence[SlowSpec | SlowCurve]) -> None:
    """Refuse a ``--slow`` naming a rank twice, where a command takes one slowdown a rank
    (decoding and serving; training takes several windows a rank)."""
    ranks = [spec.rank for spec in specs]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"--slow names rank {max(ranks, key=ranks.count)} more than once")


class Straggler:
    """Per-rank owner of the emulated slowdown; ``compute()`` wraps each piece of compute.

    ``clock`` (seconds, no argument) measures the compute, default :func:`compute_clock`
    of the device; ``sleep(seconds)`` waits out the delay, default :func:`time.sleep` (looked
    up when it sleeps, so a virtual device, :mod:`plait.testing.virtual`, can stand in).
    ``throttle(factor)``: the kernel makes the slowdown instead (see the module docstring);
    ``set_step`` then calls it with every step's factor, 1 included, and ``compute()``
    delays nothing.
    """

    def __init__(self, specs: Sequence[SlowSpec | SlowCurve], rank: int, *,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] | None = None,
                 throttle: Callable[[float], None] | None = None):
        self.specs = [s for s in specs if s.rank == rank]
        self.step = 0
        self.delayed_s = 0.0  # total emulated delay so far, for reporting
        self.clock = clock
        self.sleep = sleep
        self.throttle = throttle

    @property
    def by(self) -> str:
        """How the slowdown is made: ``"sleep"`` or ``"kernel"`` (:data:`SLOW_BY`)."""
        return "sleep" if self.throttle is None else "kernel"

    def set_step(self, step: int) -> None:
        """The step about to run; with ``throttle``, the host's budget for it is set here,
        so call it before the step starts (before the barrier that starts it together)."""
        self.step = step
        if self.throttle is not None:
            self.throttle(self.factor())

    def factor(self, step: int | None = None) -> float:
        step = self.step if step is None else step
        factor = 1.0
        for spec in self.specs:
            factor *= spec.factor_at(step)
        return factor

    @contextmanager
    def compute(self, device: torch.device | None = None) -> Iterator[None]:
        factor = self.factor()
        if factor == 1.0 or self.throttle is not None:
            yield
            return
        sync = _cuda_sync(device)
        sync()
        clock = compute_clock(device) if self.clock is None else self.clock
        start = clock()
        yield
        sync()
        delay = (factor - 1.0) * (clock() - start)
        self.delayed_s += delay
        (time.sleep if self.sleep is None else self.sleep)(delay)


def host_throttle(cgroup: str, budget: float) -> Callable[[float], None]:
    """A ``throttle`` for :class:`Straggler`: factor ``F`` sets the cgroup at ``cgroup`` (this
    rank's host's, ``rank_context().host.cgroup``) to ``budget / F`` cores; ``F = 1`` gives the
    full ``budget`` back. One rank per host: the budget is the host's, shared by its ranks.

    It writes only when the budget changes: the kernel refills the quota at every write (up to
    one period's quota more in that period), so a write every step of a steady factor would
    let the rank run over its budget by that much each step."""
    from .cgroup import set_cpu_budget

    if not budget > 0:
        raise ValueError(f"a host's full CPU budget must be above 0 cores, got {budget}")
    written: list[float] = []

    def throttle(factor: float) -> None:
        cores = budget / factor
        if written != [cores]:
            set_cpu_budget(cgroup, cores)
            written[:] = [cores]
    return throttle

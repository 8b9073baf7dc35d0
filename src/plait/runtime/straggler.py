"""Straggler emulation: make one rank FACTOR times slower at compute.

The delay is proportional to the compute the rank actually does: the work
runs, its duration ``d`` is measured, then the rank waits ``(FACTOR − 1)·d``.
On a CPU rank running one thread, ``d`` is the thread's CPU time, not wall
time: ranks sharing cores (four ranks on two) wait for the scheduler in the
middle of a GEMM, and that wait is not compute a slower device would stretch.
Giving that rank less work therefore really shortens its delay, as on a slower
device, which is what the balancer needs to be tested against. The wait is a
sleep, so the emulated slowness does not steal CPU from other ranks.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["SlowSpec", "parse_slow", "validate_slow", "Straggler", "compute_clock"]


def compute_clock(device: torch.device | None = None):
    """The clock compute is measured by: this thread's CPU time on a one-thread CPU rank (what
    the compute cost, whoever else shares the core), wall time otherwise, and wall time on a
    host with a CPU budget (``--host-cpu``): time spent throttled by the kernel is not CPU
    time, so a rank on a half-core host would read as full speed by its CPU time."""
    if _on_cpu_budget():
        return time.perf_counter
    if (device is None or device.type == "cpu") and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def _on_cpu_budget() -> bool:
    from . import context  # the rank's context, where one is set (not made here)

    ctx = context._current
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


def validate_slow(specs: Sequence[SlowSpec], world_size: int) -> None:
    """Refuse a ``--slow`` that names a rank which does not exist, before anything starts."""
    for spec in specs:
        if spec.rank >= world_size:
            raise ValueError(
                f"--slow names rank {spec.rank}, but there are only {world_size} ranks "
                f"(0..{world_size - 1})"
            )


class Straggler:
    """Per-rank owner of the emulated slowdown; ``compute()`` wraps each piece of compute.

    ``clock`` (seconds, no argument) measures the compute, default :func:`compute_clock`
    of the device; ``sleep(seconds)`` waits out the delay, default :func:`time.sleep`.
    """

    def __init__(self, specs: Sequence[SlowSpec], rank: int, *,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.specs = [s for s in specs if s.rank == rank]
        self.step = 0
        self.delayed_s = 0.0  # total emulated delay so far, for reporting
        self.clock = clock
        self.sleep = sleep

    def set_step(self, step: int) -> None:
        self.step = step

    def factor(self, step: int | None = None) -> float:
        step = self.step if step is None else step
        factor = 1.0
        for spec in self.specs:
            if spec.active(step):
                factor *= spec.factor
        return factor

    @contextmanager
    def compute(self, device: torch.device | None = None) -> Iterator[None]:
        factor = self.factor()
        if factor == 1.0:
            yield
            return
        cuda = device is not None and device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        clock = compute_clock(device) if self.clock is None else self.clock
        start = clock()
        yield
        if cuda:
            torch.cuda.synchronize(device)
        delay = (factor - 1.0) * (clock() - start)
        self.delayed_s += delay
        self.sleep(delay)

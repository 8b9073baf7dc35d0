"""The speed monitor: each rank times its own compute in every layer and shares a robust reading.

A layer's compute region (``plait.nn._shard.compute_scope`` / ``straggled``, where the
straggler emulation wraps too) reports to the layer's ``compute_timer``, which
:meth:`SpeedMonitor.attach` sets: the local GEMM on the plain path, each local piece on the
fused ``matmul_all_reduce`` and ``column_parallel_matmul`` (``plait.ops.pieces``), so
waiting for another rank's pieces is never this rank's compute (sequence-parallel and MoE
operators are still timed whole, their exposed wire included).

A rank's speed is per unit of work: the weight elements it multiplied per forward over the
seconds it took, forward and backward, so a rank given fewer heads or columns is not taken
for a faster one. Every ``every`` steps the group all_gathers one small float64 vector per
rank (``2 · layers`` figures): one *reading* each. The speed is the median of the last
``window`` readings (a preemption does not move it); ``confidence()`` is how full that window
is; after a plan change :meth:`restart` drops the readings taken under the old plan.

Clock (:func:`plait.runtime.slow.straggler.compute_clock`): on a one-thread CPU rank, the thread's
CPU time plus the emulation's sleeps in the region (ranks sharing cores are otherwise measured
slow whenever another rank runs mid-GEMM); wall time otherwise, and on a host with a CPU
budget, where a throttled rank waits for its quota and is seen slow as it is (the thread's CPU
clock is read before the wall clock at both ends, so a wait for quota falls inside).

Unmovable time (``fixed()``): what a rank spends in a training step outside the timed layers
(replicated layers, the loss, the optimizer, Python), which no plan moves: its thread CPU time
from the model's first training forward to ``step()``, less its CPU time in the timed
regions, stretched as its timed compute was (so a host slow at everything is slow at this
too); a wait in a collective takes no CPU and is not counted. Each exchange adds it as a share
of the window's movable compute at the fastest rank's speed (``plait.balance.policy``). None
on CUDA, on a CPU rank of several threads, or with another clock (0: plans by speed alone).
Some of it does move with a plan (attention over a rank's heads), so a plan takes a little too
much from a slow rank.

Cost: two clock reads per region (four on a CPU rank; CUDA: two events, read at the
exchange), and one all_gather of a few hundred bytes every ``every`` steps; ``overhead_s``
is the time spent in the exchanges.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

from ..runtime.slow.straggler import compute_clock

__all__ = ["SpeedMonitor", "LayerTimer", "ema", "relative_speeds", "flag_stragglers",
           "window_speed"]


def ema(previous: float | None, new: float, alpha: float) -> float:
    """``alpha · new + (1 − alpha) · previous``; the first figure is taken as it is."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"EMA weight alpha must be in (0, 1], got {alpha}")
    return new if previous is None else alpha * new + (1.0 - alpha) * previous


def window_speed(readings: Sequence[float]) -> float:
    """A rank's readings, the highest and lowest left out (from 3 readings on), averaged:
    one reading far off (a stall) does not move it, and a short dip that lands in two of
    five readings moves it by its share (a median would take the dip's value). 0 when it
    has none: no figure."""
    if not readings:
        return 0.0
    ordered = sorted(readings)
    kept = ordered[1:-1] if len(ordered) >= 3 else ordered
    return statistics.fmean(kept)


def relative_speeds(speeds: Sequence[float]) -> tuple[float, ...]:
    """Speeds scaled so the fastest rank is 1; a rank with no figure (≤ 0) counts as fastest."""
    speeds = [float(s) for s in speeds]
    known = [s for s in speeds if s > 0]
    if not known:
        return tuple(1.0 for _ in speeds)
    top = max(known)
    return tuple(s / top if s > 0 else 1.0 for s in speeds)


def flag_stragglers(speeds: Sequence[float], threshold: float = 1.2) -> tuple[int, ...]:
    """Ranks at least ``threshold`` × slower than the fastest (relative speed ≤ 1 / threshold)."""
    if not threshold >= 1.0:
        raise ValueError(f"a straggler threshold is a slowdown ratio ≥ 1, got {threshold}")
    rel = relative_speeds(speeds)
    return tuple(r for r, s in enumerate(rel) if s * threshold <= 1.0 + 1e-12)


_REAL_CLOCKS = (time.perf_counter, time.thread_time)


class _CPUToken(NamedTuple):
    clock: object
    start: float
    straggler: object
    delayed: float
    cpu: float  # this thread's CPU time at the start


def _straggler():
    """This rank's straggler emulation, whose sleeps count as compute (a slow device)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from ..runtime import rank_context

    return rank_context().straggler


class LayerTimer:
    """What a layer holds: ``begin(device)`` before its compute, ``end(token, work)`` after."""

    def __init__(self, monitor: "SpeedMonitor", key: str):
        self.monitor, self.key = monitor, key

    def begin(self, device: torch.device | None):
        if device is not None and device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return start
        straggler = _straggler()
        clock = compute_clock(device)
        # the thread's CPU clock first: reading it settles the kernel's accounting, which may
        # throttle the thread there, and that wait belongs before the region, not in it
        cpu = time.thread_time()
        return _CPUToken(clock, clock(), straggler, straggler.delayed_s if straggler else 0.0,
                         cpu)

    def count(self, work: float) -> None:
        """Work done in regions timed piece by piece (counted once, not per piece)."""
        self.monitor._add(self.key, 0.0, work)

    def end(self, token, work: float = 0.0) -> None:
        if isinstance(token, _CPUToken):
            slept = (token.straggler.delayed_s - token.delayed
                     if token.straggler is not None else 0.0)
            # the CPU clock first again, so a wait for quota the region used lands inside it
            # (the module doc; measured by scripts/clock_order.py)
            cpu = time.thread_time() - token.cpu
            # the wall clock ran through the sleeps; a CPU clock did not
            seconds = token.clock() - token.start
            seconds += 0.0 if token.clock is time.perf_counter else slept
            self.monitor._add(self.key, seconds, work)
            if token.clock in _REAL_CLOCKS:  # a substituted clock (a test's) has no stretch
                self.monitor._add_busy(cpu, seconds - slept)
        else:  # CUDA: read the pair at the next exchange, after one synchronize
            stop = torch.cuda.Event(enable_timing=True)
            stop.record()
            self.monitor._pending.append((self.key, token, stop, work))


class SpeedMonitor:
    """Per-rank compute speed per unit of work, a trimmed mean of a window of shared readings.

    ``attach(model)`` once; ``step()`` at the end of every training step (every
    rank: every ``every``-th call is a collective); ``restart()`` (every rank) after the
    plan changes; read ``speeds()``, ``layer_speeds(name)``, ``confidence()``,
    ``stragglers()``, ``recent(n)`` and ``step_seconds(keys)``.
    """

    def __init__(self, group=None, *, every: int = 10, window: int = 5):
        for name, value in (("every", every), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive number of "
                                 f"{'steps' if name == 'every' else 'readings'}, got {value!r}")
        self.group, self.every, self.window = group, every, window
        live = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if live else 1
        self.rank = dist.get_rank(group) if live else 0
        self.keys: list[str] = []
        self._seconds: dict[str, float] = {}
        self._work: dict[str, float] = {}
        self._pending: list = []
        self._readings: dict[str, list[deque]] = {}  # key ("" for all) → per rank, last window
        self._last_s: dict[str, list[float]] = {}  # key → per rank, the last reading's seconds
        self._window_steps = 0  # steps in the window being accumulated
        # unmovable time: this window's CPU outside the regions, the regions' CPU and their
        # time less the sleeps; the step's start (thread CPU, regions' CPU so far)
        self._outside_cpu = self._busy_cpu = self._busy_plain = 0.0
        self._busy_total = 0.0
        self._begun: tuple[float, float] | None = None
        self._fixed: list[deque] | None = None  # per rank, the last window's readings
        self.steps = 0
        self.shares = 0
        self.restarts = 0
        self.overhead_s = 0.0
        self.compute_s = 0.0  # this rank's timed compute, all layers, since it was made

    # --- wiring -------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> list[str]:
        """Give every plait layer of ``model`` (a module with ``compute_timer``) a timer."""
        names = [name for name, m in model.named_modules() if hasattr(m, "compute_timer")]
        for name in names:
            model.get_submodule(name).compute_timer = self.timer(name)

        def begins(module, args):
            if module.training and torch.is_grad_enabled():
                self.begin_step()

        model.register_forward_pre_hook(begins)
        return names

    def begin_step(self) -> None:
        """A training step begins (the model's forward; see the module doc). Only the first
        call after ``step()`` counts: a step of several forwards begins at the first."""
        if self._begun is None:
            self._begun = (time.thread_time(), self._busy_total)

    def timer(self, key: str) -> LayerTimer:
        if key not in self._seconds:
            self.keys.append(key)
            self._seconds[key], self._work[key] = 0.0, 0.0
            self._last_s[key] = [0.0] * self.world
        return LayerTimer(self, key)

    def _add(self, key: str, seconds: float, work: float) -> None:
        self._seconds[key] += seconds
        self._work[key] += work
        self.compute_s += seconds

    @property
    def region_cpu_s(self) -> float:
        """This rank's thread CPU time in the timed regions since it was made (CPU ranks; 0 on
        CUDA and with a substituted clock)."""
        return self._busy_total

    def _add_busy(self, cpu: float, plain: float) -> None:
        """A CPU region's thread CPU time and its time less the emulation's sleeps."""
        self._busy_cpu += cpu
        self._busy_plain += plain
        self._busy_total += cpu

    def _end_step(self) -> None:
        """The step's CPU outside the timed regions joins the window."""
        if self._begun is not None:
            cpu, busy = self._begun
            self._outside_cpu += max(time.thread_time() - cpu - (self._busy_total - busy), 0.0)
            self._begun = None

    def discard(self) -> None:
        """Forget the figures accumulated since the last exchange (a warm-up step, or the
        old plan's steps); no collective."""
        self._resolve_pending()
        for key in self.keys:
            self._seconds[key], self._work[key] = 0.0, 0.0
        self._window_steps = 0
        self._outside_cpu = self._busy_cpu = self._busy_plain = 0.0
        self._begun = None

    def restart(self) -> None:
        """The plan changed: drop every reading and what accumulated since the last exchange
        (all ranks, at the same step; no collective). ``confidence()`` is 0 until new
        readings come."""
        self.discard()
        self._readings.clear()
        self._fixed = None
        self.restarts += 1

    # --- the exchange ---------------------------------------------------------
    def step(self) -> bool:
        """End of a training step; every ``every``-th call shares (all ranks). True if it did."""
        self._end_step()
        self.steps += 1
        self._window_steps += 1
        if self.steps % self.every:
            return False
        self.share()
        return True

    def share(self) -> None:
        """Exchange this window's seconds and work (one all_gather), one reading per rank."""
        start = time.perf_counter()
        self._resolve_pending()
        self.shares += 1
        if not self.keys:  # nothing attached (the same on every rank): nothing to exchange
            return
        local = torch.tensor([v for k in self.keys for v in (self._seconds[k], self._work[k])]
                             + [self._unmoved()], dtype=torch.float64)  # [2·L + 1]
        table = self._gather(local).view(self.world, -1)
        pairs = table[:, :-1].reshape(self.world, len(self.keys), 2)  # [p, L, (s, work)]
        self._fold(pairs, max(self._window_steps, 1))
        self._fold_fixed(table[:, -1].tolist(), pairs)
        self.discard()
        self.overhead_s += time.perf_counter() - start

    def _resolve_pending(self) -> None:
        if self._pending:
            torch.cuda.synchronize()
            for key, begin, stop, work in self._pending:
                self._add(key, begin.elapsed_time(stop) / 1e3, work)
            self._pending.clear()

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return local.clone()
        device = "cpu"
        if dist.get_backend(self.group) == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        parts = [torch.empty_like(local, device=device) for _ in range(self.world)]
        dist.all_gather(parts, local.to(device), group=self.group)
        return torch.stack(parts).cpu()

    def _fold(self, table: torch.Tensor, steps: int) -> None:
        rows = table.tolist()  # [p][L][2]
        for i, key in enumerate(self.keys + [""]):
            for r in range(self.world):
                pairs = rows[r] if key == "" else [rows[r][i]]
                seconds, work = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
                if key:
                    self._last_s[key][r] = seconds / steps
                if seconds > 0 and work > 0:  # no figure this window: keep the others
                    ranks = self._readings.setdefault(
                        key, [deque(maxlen=self.window) for _ in range(self.world)])
                    ranks[r].append(work / seconds)

    def _unmoved(self) -> float:
        """This window's unmovable seconds, stretched as the timed compute was (see the module
        doc); −1: no figure (CUDA, a substituted clock, several threads, no step begun)."""
        if (self._busy_cpu <= 0 or self._outside_cpu <= 0 or self._busy_plain <= 0
                or torch.get_num_threads() != 1):
            return -1.0
        return self._outside_cpu * self._busy_plain / self._busy_cpu

    def _fold_fixed(self, unmoved: list[float], table: torch.Tensor) -> None:
        """One reading per rank of its unmovable time over the window's movable compute at
        the fastest rank's speed (see the module doc); none unless every rank has a figure.
        Under data parallelism each figure is already its slowest replica's."""
        seconds, work = table[..., 0].sum(dim=1).tolist(), table[..., 1].sum(dim=1).tolist()
        if any(s <= 0 or w <= 0 or u < 0 for s, w, u in zip(seconds, work, unmoved)):
            return
        fastest = max(w / s for w, s in zip(work, seconds))
        whole = sum(work) / fastest  # seconds at the fastest rank's speed
        if self._fixed is None:
            self._fixed = [deque(maxlen=self.window) for _ in range(self.world)]
        for r, u in enumerate(unmoved):
            self._fixed[r].append(u / whole)

    # --- what it says ---------------------------------------------------------
    def _speeds(self, key: str) -> tuple[float, ...]:
        ranks = self._readings.get(key)
        if ranks is None:
            return (1.0,) * self.world
        return relative_speeds([window_speed(list(q)) for q in ranks])

    def speeds(self) -> tuple[float, ...]:
        """Every rank's speed over all layers, fastest = 1 (all 1 before any reading)."""
        return self._speeds("")

    def layer_speeds(self, key: str) -> tuple[float, ...]:
        """The same for one layer (its name in the model, as ``attach`` returned it)."""
        if key not in self._seconds:
            raise ValueError(f"no layer {key!r} is timed; timed: {self.keys}")
        return self._speeds(key)

    def recent(self, n: int = 2) -> list[tuple[float, ...]]:
        """The newest ``n`` readings over all layers, oldest first, each scaled so its fastest
        rank is 1: what the window's mean lags behind (a slowdown that has just ended still
        fills the window for ``window`` readings). As many as every rank has, up to ``n``."""
        ranks = self._readings.get("")
        if ranks is None or n < 1:
            return []
        count = min(n, min(len(q) for q in ranks))
        return [relative_speeds([q[len(q) - count + i] for q in ranks]) for i in range(count)]

    def fixed(self) -> tuple[float, ...]:
        """Every rank's unmovable time per step as a share of the whole movable compute at
        the fastest rank's speed (see the module doc): the trimmed mean of its readings
        since the last restart; all 0 before any (and on CUDA)."""
        if self._fixed is None:
            return (0.0,) * self.world
        return tuple(window_speed(list(q)) for q in self._fixed)

    def confidence(self) -> float:
        """How full the window is, for the rank with fewest readings since the last
        restart: 0 (nothing yet) to 1 (``window`` readings)."""
        ranks = self._readings.get("")
        if ranks is None:
            return 0.0
        return min(len(q) for q in ranks) / self.window

    def step_seconds(self, keys: Sequence[str] | None = None) -> float:
        """The slowest rank's compute per step in ``keys`` (all layers if None) over the last
        reading (the same figure on every rank)."""
        keys = self.keys if keys is None else keys
        if not keys:
            return 0.0
        return max(sum(self._last_s[k][r] for k in keys) for r in range(self.world))

    def stragglers(self, threshold: float = 1.2) -> tuple[int, ...]:
        """Ranks at least ``threshold`` × slower than the fastest."""
        return flag_stragglers(self.speeds(), threshold)
